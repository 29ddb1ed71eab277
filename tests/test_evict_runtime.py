"""The eviction runtime on its own (no vLLM): the metadata it hands to the attention backend, step
by step, for requests that leave vLLM's persistent batch for a step and come back.

The metadata is built here the way vLLM's model runner builds it (logical lengths, the block
table as the scheduler allocates it, slots from logical positions); the cache is FlashAttention's
layout on CPU tensors; the hidden states are a fixed function of the position, so two runs that
process the same tokens see the same values.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cotserve.policies.registry import build_policy
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.evict_runtime import EvictRuntime
from cotserve.vllm.eviction_ledger import cdiv
from cotserve.vllm.flash_paged import FlashPagedKV

L, HQ, HKV, D, BS, P, NEW = 2, 4, 2, 8, 4, 40, 60
OPTS = {"budget": 16, "interval": 8, "window": 4}


def _run(leave_at: set[int]) -> tuple[EvictRuntime, RowRequest, list[int]]:
    """Prefill P tokens, then decode NEW; at the decode steps in `leave_at` the request is not
    scheduled (vLLM removes it from the batch) and is added back at the next step as a new row
    object with the same output list. Returns the runtime, the last row object and each step's
    physical length."""
    torch.manual_seed(0)
    rt = EvictRuntime(L, HQ, HKV, D, 0.3, torch.float32, torch.device("cpu"), slots=4, max_tokens=256)
    rt.delims = frozenset({3})  # token 3 closes a sentence (there is no tokenizer here)
    caches = [torch.randn(64, BS, HKV, 2 * D).transpose(1, 2) for _ in range(L)]
    table = torch.zeros(1, 40, dtype=torch.int32)
    table[0] = torch.arange(1, 41)
    paged = FlashPagedKV(BS, D)
    rows = BatchRows()
    out: list[int] = []
    req = RowRequest(list(range(P)), out, evict=build_policy("skipkv", OPTS).parts[0], prefill_len=P)
    rows.add(0, req)
    hidden = torch.zeros(256, 16)
    lengths = []

    def step(ntok: int, before: int) -> None:
        cm = SimpleNamespace(num_reqs=1, query_start_loc_cpu=torch.tensor([0, ntok]),
                             seq_lens=torch.tensor([before + ntok], dtype=torch.int32),
                             block_table_tensor=table.clone(),
                             slot_mapping=torch.tensor([int(table[0, p // BS]) * BS + p % BS
                                                        for p in range(before, before + ntok)]))
        got = rt.plan(rows, cm, BS, caches, paged, hidden)
        lengths.append(int(got.seq_lens[0]))
        for layer in range(L):  # the forward: the query rows into the ring, the new KV at the given slots
            rt.record(layer, torch.randn(ntok, HQ, D))
            k, v = caches[layer][:, :, :, :D].transpose(1, 2), caches[layer][:, :, :, D:].transpose(1, 2)
            for t in range(ntok):
                s = int(got.slot_mapping[t])
                k[s // BS, s % BS] = float(before + t)
                v[s // BS, s % BS] = float(before + t)
        for t in range(ntok):  # the last layer's hidden states: a function of the position
            hidden[t] = torch.sin(torch.arange(16) * 0.1 + before + t)

    step(P, 0)
    for s in range(NEW):
        out.append(s % 7)
        if s in leave_at:
            rows.remove(0)
            step_cm = SimpleNamespace(num_reqs=0, query_start_loc_cpu=torch.tensor([0]),
                                      seq_lens=torch.zeros(0, dtype=torch.int32),
                                      block_table_tensor=table[:0], slot_mapping=torch.zeros(0, dtype=torch.long))
            rt.plan(rows, step_cm, BS, caches, paged, hidden)
            req = RowRequest(list(range(P)), out, evict=build_policy("skipkv", OPTS).parts[0],
                             prefill_len=P + len(out))
            rows.add(0, req)
        step(1, P + s)
    return rt, req, lengths


def test_a_request_back_in_the_batch_keeps_its_compactions():
    _, stay, len_stay = _run(set())
    _, back, len_back = _run({13, 30})
    a, b = stay.evict_state, back.evict_state
    assert b.ledger.compactions == a.ledger.compactions >= 6  # after the prompt, then every 8 steps
    assert b.ledger.evicted == a.ledger.evicted and b.ledger.holes == a.ledger.holes
    assert torch.equal(b.pos, a.pos)  # the same entries kept
    assert len(b.track) == len(a.track) > 0  # the sentence track missed no token
    assert len_back == len_stay
    # every step's physical length stays within budget + interval, and the live blocks cover it
    assert max(len_stay[1:]) <= OPTS["budget"] + OPTS["interval"]
    assert len(b.ledger.live_blocks(cdiv(P + NEW, BS))) * BS >= len_stay[-1]


def test_a_compaction_without_observation_queries_scores_by_redundancy():
    """A request whose ring slot went to another request while it was out of the batch comes back
    with no observation query; if a compaction comes due before its ring refills, the redundancy
    term (and the sentence penalty) rank its entries."""
    rt, req, _ = _run(set())
    st = req.evict_state
    st.ring_pos = [-1] * rt.w
    n = st.n_phys
    k = torch.randn(1, L, HKV, n, D)
    scores = rt._scores([(req, st, None)], k, rt.positions(st, n).unsqueeze(0), n)
    assert scores.shape == (1, L, HKV, n - OPTS["window"]) and torch.isfinite(scores).all()
    assert scores.std() > 0


def _two_requests(a_away: range) -> RowRequest:
    """Requests a and b (one query-ring slot between them): a prefills and decodes; while it is out
    of the batch (`a_away`, decode steps) b prefills and decodes in its slot; then b leaves and a
    comes back as a new row object (vLLM's way) and takes the slot again. Returns a's last row."""
    torch.manual_seed(0)
    rt = EvictRuntime(L, HQ, HKV, D, 0.3, torch.float32, torch.device("cpu"), slots=1, max_tokens=256)
    rt.delims = frozenset({3})
    caches = [torch.randn(100, BS, HKV, 2 * D).transpose(1, 2) for _ in range(L)]
    tables = {"a": torch.arange(1, 41, dtype=torch.int32), "b": torch.arange(50, 90, dtype=torch.int32)}
    outs: dict[str, list[int]] = {"a": [], "b": []}
    shift = {"a": 0.0, "b": 50.0}
    reqs = {n: RowRequest(list(range(P)), outs[n], evict=build_policy("skipkv", OPTS).parts[0], prefill_len=P)
            for n in "ab"}
    done = {"a": 0, "b": 0}
    hidden = torch.zeros(256, 16)

    def step(names: list[str]) -> None:
        rows = BatchRows()
        qsl, lens, slots, firsts = [0], [], [], []
        for j, n in enumerate(names):
            rows.add(j, reqs[n])
            before = done[n]
            ntok = P if before == 0 else 1
            if before:
                outs[n].append((before - P) % 7)  # the token this step computes
            qsl.append(qsl[-1] + ntok)
            lens.append(before + ntok)
            firsts.append(before)
            slots += [int(tables[n][p // BS]) * BS + p % BS for p in range(before, before + ntok)]
        cm = SimpleNamespace(num_reqs=len(names), query_start_loc_cpu=torch.tensor(qsl),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_table_tensor=torch.stack([tables[n] for n in names]) if names else
                             torch.zeros(0, 40, dtype=torch.int32),
                             slot_mapping=torch.tensor(slots, dtype=torch.long))
        got = rt.plan(rows, cm, BS, caches, FlashPagedKV(BS, D), hidden)
        for layer in range(L if names else 0):  # vLLM runs no forward without tokens
            rt.record(layer, torch.randn(qsl[-1], HQ, D))
        for j, n in enumerate(names):
            for t in range(qsl[j], qsl[j + 1]):
                p = firsts[j] + t - qsl[j]
                hidden[t] = torch.sin(torch.arange(16) * 0.1 + p * 0.37 + shift[n])
                s = int(got.slot_mapping[t])
                for layer in range(L):
                    caches[layer][s // BS, :, s % BS] = float(p)
            done[n] = lens[j]

    step(["a"])
    for s in range(40 + len(a_away)):  # a decodes 40 steps
        if s in a_away:
            step(["b"])
            if s + 1 not in a_away:  # a comes back: vLLM re-adds it as a new row with the same output list
                reqs["a"] = RowRequest(list(range(P)), outs["a"], evict=build_policy("skipkv", OPTS).parts[0],
                                       prefill_len=P + len(outs["a"]))
        else:
            step(["a"])
    step([])
    return reqs["a"]


def test_a_request_whose_slot_changed_hands_keeps_its_sentence_track():
    """The open sentence's hidden-state sum moves with the request when another request takes its
    ring slot and when it takes one back: its sentences and their embeddings equal those of a run
    in which it never left."""
    alone = _two_requests(range(0)).evict_state.track
    moved = _two_requests(range(15, 26)).evict_state.track
    assert len(alone) >= 4 and alone.starts == moved.starts and alone.ends == moved.ends
    assert torch.equal(alone.emb, moved.emb) and alone.penalty == moved.penalty
    assert alone.open_n == moved.open_n


def test_the_batched_sentence_feed_equals_the_tracks_own_feed():
    """`SentenceTrack.count` plus the runtime's one-add-per-step sum give the same sentences,
    embeddings and penalties as the track fed token by token."""
    from cotserve.policies.skipkv import SentenceTrack

    track = _two_requests(range(0)).evict_state.track
    ref = SentenceTrack(frozenset({3}), OPTS.get("sentence_threshold", build_policy("skipkv", OPTS).parts[0]
                                                  .config.sentence_threshold))
    ref.skip(P)
    for s in range(40):
        ref.feed([s % 7], torch.sin(torch.arange(16) * 0.1 + (P + s) * 0.37).unsqueeze(0))
    assert ref.starts == track.starts and ref.ends == track.ends and len(ref) >= 4
    assert torch.equal(ref.emb, track.emb) and ref.penalty == track.penalty
