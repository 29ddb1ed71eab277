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
from cotserve.vllm.evict_runtime import EvictRuntime
from cotserve.vllm.eviction_ledger import cdiv
from cotserve.vllm.flash_paged import FlashPagedKV
from cotserve.vllm.requests import BatchRows, RowRequest

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
