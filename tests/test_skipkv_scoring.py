"""Scoring pieces (cotserve.policies.scoring) against direct loop computations on random tensors,
the sentence tracker, and the rkv/skipkv compaction on a hand-built cache (no model)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from cotserve.kv.batch import BatchState, ModelInfo
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.policies import scoring
from cotserve.policies.base import PolicyStack
from cotserve.policies.registry import build_policy
from cotserve.policies.rkv import RKVConfig, rkv_scores
from cotserve.policies.skipkv import SentenceTrack

HQ, HKV, D = 6, 2, 16


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def direct_importance(q, k, scaling, window, kernel, q_pos, k_pos, gqa_pool="prob", normalize="causal"):
    """Loop form of R-KV Sec. 3.2 importance, one number at a time."""
    hq, w, _ = q.shape
    hkv, n, _ = k.shape
    g = hq // hkv
    m = n - window
    out = torch.zeros(hkv, m)
    for h in range(hkv):
        raw = torch.zeros(m)
        if gqa_pool == "prob":
            per_head = []
            for gi in range(g):
                acc = torch.zeros(m)
                for t in range(w):
                    cols = [j for j in range(n if normalize == "causal" else m) if k_pos[h, j] <= q_pos[t]]
                    logit = torch.tensor([float(q[h * g + gi, t] @ k[h, j]) * scaling for j in cols])
                    p = torch.softmax(logit, 0)
                    for c, j in enumerate(cols):
                        if j < m:
                            acc[j] += p[c] / w
                per_head.append(acc)
            raw = torch.stack(per_head).amax(0)
        else:  # max over the group's logits, then softmax
            for t in range(w):
                cols = [j for j in range(n if normalize == "causal" else m) if k_pos[h, j] <= q_pos[t]]
                logit = torch.tensor([max(float(q[h * g + gi, t] @ k[h, j]) for gi in range(g)) * scaling
                                      for j in cols])
                p = torch.softmax(logit, 0)
                for c, j in enumerate(cols):
                    if j < m:
                        raw[j] += p[c] / w
        for j in range(m):
            lo, hi = max(0, j - kernel // 2), min(m, j + kernel // 2 + 1)
            out[h, j] = raw[lo:hi].max()
    return out


@pytest.mark.parametrize("gqa_pool", ["prob", "logit"])
@pytest.mark.parametrize("normalize", ["causal", "past"])
def test_importance_matches_direct(gqa_pool, normalize):
    n, w, window, kernel = 30, 5, 5, 7
    q, k = rand(HQ, w, D, seed=1), rand(HKV, n, D, seed=2)
    k_pos = torch.arange(n).expand(HKV, -1) * 2  # true positions need not be contiguous
    q_pos = k_pos[0, -w:]
    got = scoring.attention_importance(q, k, 0.25, window, kernel, q_pos=q_pos, k_pos=k_pos,
                                       gqa_pool=gqa_pool, normalize=normalize)
    want = direct_importance(q, k, 0.25, window, kernel, q_pos, k_pos, gqa_pool, normalize)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_importance_is_causal_inside_the_window():
    """A window query never attends to a later window key: changing the last key changes nothing
    for the other queries' view of the candidates under 'past' (and 'causal' excludes it)."""
    n, w = 20, 4
    q, k = rand(HQ, w, D, seed=3), rand(HKV, n, D, seed=4)
    pos = torch.arange(n).expand(HKV, -1)
    a = scoring.window_attention(q, k, 0.3, q_pos=pos[0, -w:], k_pos=pos)
    assert torch.all(a[:, 0, -w + 1:] == 0)  # the first window query sees none of the later ones
    torch.testing.assert_close(a.sum(-1), torch.ones(HQ, w))


def direct_redundancy(k, threshold, retain, quirk=False):
    hkv, n, _ = k.shape
    out = torch.zeros(hkv, n)
    for h in range(hkv):
        s = torch.zeros(n, n)
        for i in range(n):
            for j in range(n):
                if i != j:
                    s[i, j] = float(k[h, i] @ k[h, j]) / (k[h, i].norm() * k[h, j].norm())
        for i in range(n):
            similar = [j for j in range(n) if s[i, j] > threshold]
            for j in sorted(similar, reverse=True)[:retain]:
                s[i, j] = 0.0
            if quirk and not similar:
                s[i, 0] = 0.0
        out[h] = torch.softmax(s.mean(0), 0)
    return out


@pytest.mark.parametrize("retain,quirk", [(1, False), (2, False), (1, True), (0, False), (0, True)])
@pytest.mark.parametrize("fn", [scoring.key_redundancy, scoring.key_redundancy_reference])
def test_redundancy_matches_direct(fn, retain, quirk):
    k = rand(HKV, 24, 4, seed=5)  # low dimension: many pairs above the threshold
    got = fn(k, 0.5, retain, quirk)
    torch.testing.assert_close(got, direct_redundancy(k, 0.5, retain, quirk), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("threshold", [-0.2, 0.1, 0.5, 0.75])
@pytest.mark.parametrize("retain,quirk", [(1, False), (1, True), (0, True)])
def test_fast_redundancy_matches_the_reference(threshold, retain, quirk):
    """The column-sum form against the masked-matrix form on larger heads, rows with and without
    copies (a high threshold leaves many rows without any)."""
    k = rand(6, 300, 8, seed=11)
    got = scoring.key_redundancy(k, threshold, retain, quirk)
    ref = scoring.key_redundancy_reference(k, threshold, retain, quirk)
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-5)
    assert not torch.equal(got, scoring.key_redundancy_reference(k, threshold, retain + 1, quirk))


def test_redundancy_ranks_older_copies_higher():
    base = rand(1, 8, D, seed=6)
    k = base.clone()
    k[0, 4] = base[0, 1] * 0.5  # two newer copies of key 1 (same direction)
    k[0, 6] = base[0, 1] * 1.5
    red = scoring.key_redundancy(k, 0.9, 1)
    assert red[0, 1] > red[0, 4] > red[0, 6]  # the older a copy, the more redundant


def test_max_pool_and_select_keep():
    x = rand(3, 17, seed=7)
    pooled = scoring.max_pool(x, 5)
    for h in range(3):
        for j in range(17):
            assert pooled[h, j] == x[h, max(0, j - 2): j + 3].max()
    keep = scoring.select_keep(x, budget=9, window=4)  # 17 candidates + 4 recent
    for h in range(3):
        top = set(x[h].topk(5).indices.tolist())
        assert keep[h].tolist() == sorted(top | {17, 18, 19, 20})


def test_mix_scores():
    i, r = rand(2, 5, seed=8), rand(2, 5, seed=9)
    torch.testing.assert_close(scoring.mix_scores(i, r, 0.1), 0.1 * i - 0.9 * r)


# -- sentence tracker ----------------------------------------------------------------------
DELIM = 99


def test_sentence_track_spans_embeddings_penalties():
    ids = [1, 2, DELIM, DELIM, 3, 4, 5, DELIM, 1, 2, DELIM, 7]
    hidden = rand(len(ids), 8, seed=10)
    hidden[8:10] = hidden[0:2]  # sentence 3 repeats sentence 1 token for token
    hidden[10] = hidden[2]
    whole = SentenceTrack(frozenset({DELIM}), tau=0.95)
    whole.feed(ids, hidden)
    parts = SentenceTrack(frozenset({DELIM}), tau=0.95)
    for a, b in [(0, 3), (3, 4), (4, 9), (9, 12)]:  # fed in pieces, as decode does
        parts.feed(ids[a:b], hidden[a:b])
    for t in (whole, parts):
        # a run of delimiters stays with the next sentence; the open tail is no sentence yet
        assert list(zip(t.starts, t.ends, strict=True)) == [(0, 3), (3, 8), (8, 11)]
        assert t.next_pos == 12
        for s, (a, b) in enumerate(zip(t.starts, t.ends, strict=True)):
            v = hidden[a:b].mean(0)
            torch.testing.assert_close(t.emb[s], v / v.norm())
        assert t.penalty[0] == pytest.approx(1.0, abs=1e-5)  # the EARLIER copy is marked
        assert t.penalty[1] == 0.0 and t.penalty[2] == 0.0
        pos = torch.tensor([[0, 2, 3, 7, 8, 11]])
        assert t.sentence_of(pos).tolist() == [[0, 0, 1, 1, 2, -1]]
        assert t.penalty_of(pos)[0, :2].tolist() == pytest.approx([1.0, 1.0], abs=1e-5)


# -- compaction on a hand-built cache --------------------------------------------------------
def make_batch(stack: PolicyStack, layers=2, n=40, seed=11) -> BatchState:
    info = ModelInfo(num_layers=layers, num_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=8,
                     max_positions=4096)
    plen = torch.tensor([n, n - 7])
    cap = stack.capacity(plen.tolist(), 64)
    cache = KVCache(CacheShape(layers, 2, HKV, cap, D), torch.float32, torch.device("cpu"))
    batch = BatchState(info=info, cache=cache, policy=stack, scaling=1 / math.sqrt(D), prompt_lens=plen,
                       tokens=[list(range(n)), list(range(n - 7))], active=torch.ones(2, dtype=torch.bool))
    stack.begin(batch)
    batch.mode = "prefill"
    for layer in range(layers):
        k, v = rand(2, HKV, n, D, seed=seed + layer), rand(2, HKV, n, D, seed=seed + 50 + layer)
        q = rand(2, HQ, n, D, seed=seed + 100 + layer)
        cache.write_prefill(layer, k, v, plen)
        stack.prefill_attention(layer, q, k, v, batch)
        batch.extras[f"q{layer}"], batch.extras[f"k{layer}"] = q, k
    batch.hidden = rand(2, n, 8, seed=seed + 200)
    return batch


def test_rkv_compaction_keeps_what_the_score_says():
    cfg = {"budget": "20", "interval": "4", "window": "4"}
    stack = build_policy("rkv", cfg)
    c: RKVConfig = stack.parts[0].config
    batch = make_batch(stack)
    before = {lay: batch.cache.k[lay].clone() for lay in range(2)}
    stack.after_forward(batch)  # prefill: both prompts exceed the budget
    for slot, plen in enumerate(batch.prompt_lens.tolist()):
        for lay in range(2):
            q = batch.extras[f"q{lay}"][slot, :, plen - 4:plen]
            k = batch.extras[f"k{lay}"][slot, :, :plen]
            pos = torch.arange(plen).expand(HKV, -1)
            want = scoring.select_keep(rkv_scores(q, pos[0, -4:], k, pos, batch.scaling, c), 20, 4)
            assert batch.cache.lens[lay, slot] == 20
            assert torch.equal(batch.cache.pos[lay, slot, :, :20], want)  # positions = original indices
            kept = torch.gather(before[lay][slot, :, :plen], 1, want.unsqueeze(-1).expand(-1, -1, D))
            assert torch.equal(batch.cache.k[lay, slot, :, :20], kept)
            assert torch.all(batch.cache.pos[lay, slot, :, 20:] == -1)
    tele = stack.telemetry(0)
    assert tele["compactions"] == 1 and tele["evicted_tokens"] == 40 - 20


def test_capacity_is_budget_plus_interval():
    stack = build_policy("skipkv", {"budget": "64", "interval": "16"})
    assert stack.capacity([10, 30], 1000) == 80
    assert stack.capacity([300], 1000) == 300  # prefill needs the whole prompt, compacted at once
    assert stack.capacity([10], 20) == 31  # never more than the full length


@pytest.mark.parametrize("opt", [{"budget": "8", "window": "8"}, {"interval": "0"}, {"pool_width": "4"},
                                 {"sigma": "2"}, {"group_reduce": "mean"}, {"sentence_threshold": "3"},
                                 {"kernel": "7"}, {"tau": "0.9"}, {"gqa_pool": "prob"}])
def test_bad_options_are_refused(opt):
    from cotserve.errors import PolicyError

    with pytest.raises(PolicyError):
        build_policy("skipkv", opt)


@pytest.mark.parametrize("retain,quirk", [(1, False), (1, True), (0, False)])
@pytest.mark.parametrize("max_floats", [300 * 40, 300 * 300 + 1, 2 * 300 * 300])
def test_redundancy_in_chunks_matches_one_chunk(retain, quirk, max_floats):
    """Rows (and heads) in blocks of at most `max_floats` similarities give the one-block result."""
    k = rand(6, 300, 8, seed=12)
    whole = scoring.key_redundancy(k, 0.3, retain, quirk, max_floats=10**9)
    got = scoring.key_redundancy(k, 0.3, retain, quirk, max_floats=max_floats)
    torch.testing.assert_close(got, whole, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(got, scoring.key_redundancy_reference(k, 0.3, retain, quirk), atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_redundancy_memory_is_bounded_by_its_chunks():
    """Under an address-space limit below one head's n x n similarities, the chunked redundancy runs
    and the whole matrix cannot be made (the eviction of a long prompt used to ask for 30 GiB)."""
    code = (
        "import resource, torch\n"
        "from cotserve.policies import scoring\n"
        "torch.set_num_threads(1)\n"
        "k = torch.randn(8, 12000, 8, generator=torch.Generator().manual_seed(0))\n"
        "whole = 12000 * 12000 * 4\n"
        "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + whole // 2, vm + whole // 2))\n"
        "red = scoring.key_redundancy(k, 0.5, 1, max_floats=1 << 23)\n"
        "print('chunked', tuple(red.shape), round(float(red.sum()), 3))\n"
        "try:\n"
        "    scoring.key_similarity(k[:1])\n"
        "    print('whole made')\n"
        "except (RuntimeError, MemoryError):\n"
        "    print('whole refused')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["chunked (8, 12000) 8.0", "whole refused"], proc.stdout + proc.stderr[-2000:]
