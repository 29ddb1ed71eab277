"""Baseline policies (streamingllm, h2o, snapkv, quest): each keeps/reads what its paper says.

Random-tensor tests compare each piece with a direct computation written here; engine tests run the
bundled model with small budgets and check the cache itself (positions, lengths) afterwards."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.kv.batch import BatchState, ModelInfo
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.policies.attention_parts import attend, causal_prefill_with_colsums, decode_probs
from cotserve.policies.base import Policy, PolicyStack, causal_prefill, dense_decode, grouped_attention
from cotserve.policies.h2o import H2OConfig, H2OPolicy
from cotserve.policies.quest import (
    QuestConfig,
    QuestPolicy,
    page_bounds,
    page_upper_bounds,
    select_pages,
)
from cotserve.policies.registry import build_policy
from cotserve.policies.snapkv import snapkv_keep, snapkv_scores

# ---------------------------------------------------------------------------------------------
# helpers


def _batch(layers=1, slots=2, hkv=2, hq=4, cap=128, d=8, prompt_lens=(20, 14), policy=None) -> BatchState:
    cache = KVCache(CacheShape(layers, slots, hkv, cap, d), torch.float32, torch.device("cpu"))
    info = ModelInfo(num_layers=layers, num_heads=hq, num_kv_heads=hkv, head_dim=d, hidden_size=hq * d,
                     max_positions=4096)
    stack = policy if isinstance(policy, PolicyStack) else PolicyStack([policy] if policy else [])
    return BatchState(info=info, cache=cache, policy=stack, scaling=d**-0.5,
                      prompt_lens=torch.tensor(prompt_lens), tokens=[[0] * n for n in prompt_lens])


class _Recorder(Policy):
    """Test-only policy: records each layer's prompt q/k (the engine's default attention runs)."""

    name = "test_recorder"

    def __init__(self):
        super().__init__()
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def prefill_attention(self, layer, q, k, v, batch):
        self.q[layer], self.k[layer] = q.clone(), k.clone()
        return None


def _record(engine, prompt: list[int]) -> _Recorder:
    rec = _Recorder()
    engine.generate([GenRequest(prompt, SamplingParams(max_tokens=1))], PolicyStack([rec]))
    return rec


def _prompt(engine, n: int) -> list[int]:
    text = ("Problem: compute the sum of the first n odd numbers and prove the formula by induction. "
            "Solution: the first odd number is 1, then 3, 5 and so on; the sum of the first n is n squared.\n")
    ids = engine.tokenizer.encode(text * 20)
    assert len(ids) >= n
    return ids[:n]


def _run(engine, prompts, spec, opts, new=8):
    stack = build_policy(spec, opts)
    res = engine.generate([GenRequest(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts], stack)
    return stack, res


def _assert_top_set(scores: torch.Tensor, kept: set[int], k: int, tol: float = 0.0) -> None:
    """`kept` is a valid top-k set of `scores` (ties, e.g. max-pooling plateaus, may go either way)."""
    assert len(kept) == k
    inside = scores[sorted(kept)]
    outside = scores[[j for j in range(scores.shape[0]) if j not in kept]]
    if outside.numel():
        assert float(inside.min()) >= float(outside.max()) - tol


def _garbage_tail(cache: KVCache, value: float = 1e4) -> None:
    """Write huge values behind every slot's valid entries (they must never be attended)."""
    for layer in range(cache.shape.layers):
        for slot in range(cache.shape.slots):
            n = int(cache.lens[layer, slot])
            cache.k[layer, slot, :, n:] = value
            cache.v[layer, slot, :, n:] = value


# ---------------------------------------------------------------------------------------------
# shared pieces on random tensors


def test_decode_probs_match_reference_and_ignore_invalid():
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 6, 2, 30, 8
    q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    lens = torch.tensor([30, 17])
    valid = torch.arange(s).unsqueeze(0) < lens.unsqueeze(1)
    ref = grouped_attention(q, k, v, valid.unsqueeze(1), 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 17:], v2[1, :, 17:] = 1e4, 1e4
    out = attend(decode_probs(q, k2, valid, 0.3), v2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a per-KV-head mask: head 1 of slot 0 reads only its first 5 entries
    mask = valid.unsqueeze(1).repeat(1, hkv, 1)
    mask[0, 1, 5:] = False
    out = attend(decode_probs(q, k, mask, 0.3), v)
    direct = grouped_attention(q[:, 3:6], k[:, 1:2, :5], v[:, 1:2, :5], None, 0.3)
    torch.testing.assert_close(out[0:1, 3:6], direct[0:1], rtol=1e-5, atol=1e-5)


def test_prefill_colsums_match_dense_computation():
    torch.manual_seed(1)
    b, hq, hkv, t, d = 2, 4, 2, 23, 8
    q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    lengths = torch.tensor([23, 15])
    out, col = causal_prefill_with_colsums(q, k, v, lengths, 0.35, max_elems=b * hq * t * 5)  # 5-row chunks
    torch.testing.assert_close(out, causal_prefill(q, k, v, 0.35), rtol=1e-5, atol=1e-5)
    kr = k.repeat_interleave(hq // hkv, dim=1)
    logits = torch.matmul(q, kr.transpose(-1, -2)) * 0.35
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    probs = logits.softmax(-1)
    for i, n in enumerate(lengths.tolist()):
        direct = probs[i, :, :n, :].sum(1)  # only the real query rows vote
        torch.testing.assert_close(col[i], direct, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# h2o


def _h2o_reference(qs_prefill, ks, qs_decode, budget, recent, scaling):
    """Direct H2O on one sequence, one KV head group: python dict position -> score, dense attention
    over the kept positions at every step, evict the lowest non-recent when over budget."""
    t = qs_prefill.shape[1]
    logits = torch.einsum("htd,sd->hts", qs_prefill, ks[:t]) * scaling
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    col = logits.softmax(-1).sum(1).sum(0)  # group sum, rows summed
    scores = {j: float(col[j]) for j in range(t)}

    def evict():
        while len(scores) > budget:
            order = sorted(scores)
            old = order[: len(order) - recent]
            for j in sorted(old, key=lambda j: scores[j])[: len(scores) - budget]:
                del scores[j]

    evict()
    for step, qd in enumerate(qs_decode):
        p = t + step
        scores[p] = 0.0
        kept = sorted(scores)
        pr = (torch.einsum("hd,sd->hs", qd, ks[kept]) * scaling).softmax(-1).sum(0)
        for j, w in zip(kept, pr.tolist(), strict=True):
            scores[j] += w
        evict()
    return scores


def test_h2o_matches_direct_computation_through_compactions():
    torch.manual_seed(2)
    hq, hkv, d, t, steps, budget = 2, 1, 8, 24, 30, 12
    ks = torch.randn(t + steps, d)
    qp, qd = torch.randn(hq, t, d), torch.randn(steps, hq, d)
    pol = H2OPolicy(H2OConfig(budget=budget, recent_ratio=0.25))
    batch = _batch(slots=1, hkv=hkv, hq=hq, d=d, cap=64, prompt_lens=(t,), policy=pol)
    pol.begin(batch)
    k = ks[:t].view(1, 1, t, d)
    batch.cache.write_prefill(0, k, k.clone(), batch.prompt_lens)
    pol.prefill_attention(0, qp.unsqueeze(0), k, k.clone(), batch)
    pol.after_forward(batch)
    batch.mode = "decode"
    for step in range(steps):
        kk = ks[t + step].view(1, 1, 1, d)
        batch.cache.write_decode(0, kk, kk.clone(), torch.tensor([t + step]))
        pol.decode_attention(0, qd[step].view(1, hq, 1, d), batch)
        pol.after_forward(batch)
        assert int(batch.cache.lens[0, 0]) == budget  # interval=1: back to budget after each step
    ref = _h2o_reference(qp, ks, qd, budget, pol.config.recent, batch.scaling)
    n = int(batch.cache.lens[0, 0])
    kept = batch.cache.pos[0, 0, 0, :n].tolist()
    assert kept == sorted(ref)
    torch.testing.assert_close(pol.scores[0, 0, 0, :n], torch.tensor([ref[j] for j in kept]), rtol=1e-4, atol=1e-5)


def test_h2o_decode_output_is_dense_attention():
    torch.manual_seed(3)
    pol = H2OPolicy(H2OConfig(budget=64))
    batch = _batch(policy=pol)
    pol.begin(batch)
    k, v = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    batch.cache.write_prefill(0, k, v, batch.prompt_lens)
    batch.mode = "decode"
    kk = torch.randn(2, 2, 1, 8)
    batch.cache.write_decode(0, kk, kk, torch.tensor([20, 14]))
    _garbage_tail(batch.cache)
    q = torch.randn(2, 4, 1, 8)
    torch.testing.assert_close(pol.decode_attention(0, q, batch), dense_decode(q, batch, 0))


def test_h2o_engine_keeps_heavy_hitters_of_direct_attention(engine):
    prompt = _prompt(engine, 96)
    rec = _record(engine, prompt)
    budget = 32
    stack, _ = _run(engine, [prompt], "h2o", {"budget": budget}, new=1)
    pol = stack.parts[0]
    cache = pol.batch.cache
    recent = pol.config.recent
    for layer in range(engine.info.num_layers):
        q, k = rec.q[layer][0], rec.k[layer][0]  # [Hq, T, D], [Hkv, T, D]
        g = q.shape[0] // k.shape[0]
        logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(g, 0)) * engine.scaling
        logits = logits.masked_fill(~torch.ones(96, 96, dtype=torch.bool).tril(), float("-inf"))
        col = logits.softmax(-1).sum(1).view(k.shape[0], g, -1).sum(1)  # [Hkv, T]
        for h in range(k.shape[0]):
            kept = set(cache.pos[layer, 0, h, :budget].tolist())
            heavy = set(col[h, : 96 - recent].topk(budget - recent).indices.tolist())
            assert kept == heavy | set(range(96 - recent, 96)), (layer, h)
            # the scores moved with their entries through the compaction
            pos = cache.pos[layer, 0, h, :budget]
            torch.testing.assert_close(pol.scores[layer, 0, h, :budget], col[h, pos], rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# snapkv


def _snapkv_direct(q, k, scaling, window, kernel, pooling):
    """Loops over keys: Eq. (1) votes, group mean, then the pooling window by hand."""
    hq, n, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = torch.zeros(hkv, n - window)
    for h in range(hkv):
        votes = torch.zeros(n - window)
        for qh in range(h * g, (h + 1) * g):
            for i in range(n - window, n):
                p = (q[qh, i] @ k[h, : i + 1].T * scaling).softmax(-1)
                votes += p[: n - window] / g
        for j in range(n - window):
            lo, hi = max(0, j - kernel // 2), min(n - window, j + kernel // 2 + 1)
            out[h, j] = votes[lo:hi].max() if pooling == "max" else votes[lo:hi].sum() / kernel
    return out


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_scores_match_direct_computation(pooling):
    torch.manual_seed(4)
    q, k = torch.randn(4, 40, 8), torch.randn(2, 40, 8)
    got = snapkv_scores(q, k, 0.35, window=6, kernel=5, pooling=pooling)
    torch.testing.assert_close(got, _snapkv_direct(q, k, 0.35, 6, 5, pooling), rtol=1e-5, atol=1e-6)
    keep = snapkv_keep(got, 40, budget=16, window=6)
    for h in range(2):
        kept = set(keep[h].tolist())
        assert set(range(34, 40)) <= kept
        _assert_top_set(got[h], kept - set(range(34, 40)), 10)


def test_snapkv_engine_keeps_pooled_window_top_and_never_evicts_later(engine):
    p_long, p_short = _prompt(engine, 90), _prompt(engine, 40)
    rec = _record(engine, p_long)
    budget, window = 48, 8
    stack, res = _run(engine, [p_long, p_short], "snapkv", {"budget": budget, "window": window}, new=6)
    cache = stack.parts[0].batch.cache
    slot_long = 1  # group_by_length sorts the batch by prompt length
    for layer in (0, 7, 29):
        pooled = snapkv_scores(rec.q[layer][0], rec.k[layer][0], engine.scaling, window, 7, "max")
        for h in range(engine.info.num_kv_heads):
            got = cache.pos[layer, slot_long, h, :budget].tolist()
            assert got == sorted(got) and set(range(90 - window, 90)) <= set(got)
            _assert_top_set(pooled[h], set(got) - set(range(90 - window, 90)), budget - window, tol=1e-6)
            # decoding only appended (no eviction): the generated positions follow in order
            assert cache.pos[layer, slot_long, h, budget:].tolist()[:5] == list(range(90, 95))
    assert cache.lens[:, slot_long].eq(budget + 5).all()
    assert cache.lens[:, 0].eq(40 + 5).all()  # a prompt within budget is kept whole
    assert res[0].telemetry["evicted_tokens"] == 90 - budget


# ---------------------------------------------------------------------------------------------
# streamingllm


def test_streamingllm_keeps_exactly_sink_and_recent(engine):
    p_long, p_short = _prompt(engine, 70), _prompt(engine, 30)
    stack, res = _run(engine, [p_long, p_short], "streamingllm", {"budget": 24, "sinks": 4}, new=10)
    cache = stack.parts[0].batch.cache
    per_entry = 2 * engine.info.num_kv_heads * engine.info.head_dim * 4 * engine.info.num_layers
    for slot, plen in ((1, 70), (0, 30)):
        last = plen + 10 - 2  # positions written: prompt, then 9 decode steps (the 1st token is from prefill)
        want = [0, 1, 2, 3, *range(last - 19, last + 1)]
        assert cache.lens[:, slot].eq(24).all()
        assert cache.pos[:, slot, :, :24].eq(torch.tensor(want)).all()
        assert cache.pos[:, slot, :, 24:].eq(-1).all()
    for r in res:  # the peak is taken before compactions: the whole prompt, then budget + 1 per step
        assert r.telemetry["kv_bytes_peak"] == max(r.prompt_tokens, 24 + 1) * per_entry
        assert r.telemetry["kv_bytes_final"] == 24 * per_entry


def test_streamingllm_every_n_bounds_the_cache(engine):
    prompt = _prompt(engine, 60)
    stack, (r,) = _run(engine, [prompt], "streamingllm", {"budget": 20, "sinks": 2, "interval": 4}, new=12)
    per_entry = 2 * engine.info.num_kv_heads * engine.info.head_dim * 4 * engine.info.num_layers
    assert r.telemetry["kv_bytes_after_prefill"] == 20 * per_entry
    assert r.telemetry["kv_bytes_peak"] == 60 * per_entry  # the prompt, before the prefill compaction
    assert r.telemetry["kv_bytes_final"] <= (20 + 4 - 1) * per_entry
    cache = stack.parts[0].batch.cache
    n = int(cache.lens[0, 0])
    pos = cache.pos[0, 0, 0, :n].tolist()
    last = 60 + 12 - 2
    assert pos == [0, 1, *range(last - (n - 2) + 1, last + 1)]


# ---------------------------------------------------------------------------------------------
# quest


def test_quest_bounds_are_upper_bounds_and_selection_is_top_pages():
    torch.manual_seed(5)
    b, hq, hkv, s, d, ps = 2, 6, 2, 45, 8, 4
    k = torch.randn(b, hkv, s, d)
    lens = torch.tensor([45, 30])
    q = torch.randn(b, hq, 1, d)
    for how in ("sum", "max"):
        mins = torch.zeros(b, hkv, 12, d)
        maxs = torch.zeros(b, hkv, 12, d)
        for i in range(b):
            lo, hi = page_bounds(k[i], int(lens[i]), ps)
            mins[i, :, : lo.shape[1]], maxs[i, :, : hi.shape[1]] = lo, hi
        ub = page_upper_bounds(q, mins, maxs, how)  # [B, Hkv, P]
        logits = torch.einsum("bhgd,bhsd->bhgs", q.view(b, hkv, 3, d), k)
        for i in range(b):
            n = int(lens[i])
            for p in range(-(-n // ps)):
                page = logits[i, :, :, p * ps : min(n, (p + 1) * ps)]  # [Hkv, G, tokens]
                true = page.sum(1).amax(-1) if how == "sum" else page.amax(1).amax(-1)
                assert (ub[i, :, p] >= true - 1e-5).all()
        pages, ok = select_pages(ub, lens, ps, top=3)
        for i in range(b):
            cur = (int(lens[i]) - 1) // ps
            for h in range(hkv):
                direct = set(torch.argsort(ub[i, h, :cur], descending=True)[:3].tolist()) | {cur}
                assert set(pages[i, h][ok[i, h]].tolist()) == direct


def test_quest_incremental_bounds_and_output_match_masked_reference():
    torch.manual_seed(6)
    pol = QuestPolicy(QuestConfig(budget=8, page_size=4, dense_layers=0))
    batch = _batch(policy=pol, cap=64, prompt_lens=(13, 6))
    pol.begin(batch)
    k, v = torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    batch.cache.write_prefill(0, k, v, batch.prompt_lens)
    batch.mode = "decode"
    for step in range(11):
        kk, vv = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
        batch.cache.write_decode(0, kk, vv, batch.prompt_lens + step)
        _garbage_tail(batch.cache)
        q = torch.randn(2, 4, 1, 8)
        out = pol.decode_attention(0, q, batch)
        lens = batch.cache.lens[0]
        # bounds kept step by step equal a rebuild from scratch
        for i in range(2):
            lo, hi = page_bounds(batch.cache.k[0, i], int(lens[i]), 4)
            torch.testing.assert_close(pol.mins[0][i, :, : lo.shape[1]], lo)
            torch.testing.assert_close(pol.maxs[0][i, :, : hi.shape[1]], hi)
        # the output is dense attention restricted to the selected pages (a mask per KV head)
        kc, vc, valid = batch.cache.view(0)
        s = kc.shape[2]
        ub = page_upper_bounds(q, pol.mins[0][:, :, : -(-s // 4)], pol.maxs[0][:, :, : -(-s // 4)], "sum")
        pages, ok = select_pages(ub, lens, 4, top=2)
        mask = torch.zeros(2, 2, s, dtype=torch.bool)
        for i in range(2):
            for h in range(2):
                for p in pages[i, h][ok[i, h]].tolist():
                    mask[i, h, p * 4 : (p + 1) * 4] = True
        mask &= valid.unsqueeze(1)
        assert mask.sum(-1).le(3 * 4).all()
        ref = attend(decode_probs(q, kc, mask, batch.scaling), vc)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert pol.rebuilds == 2  # once per slot (first step); afterwards incremental only


def test_quest_covering_budget_equals_dense_and_small_budget_reads_less(engine):
    prompts = [_prompt(engine, 80), _prompt(engine, 50)]
    _, dense = _run(engine, prompts, "dense", {}, new=8)
    _, full = _run(engine, prompts, "quest", {"budget": 256, "page_size": 16}, new=8)
    for a, b in zip(dense, full, strict=True):
        assert a.token_ids == b.token_ids
        assert b.telemetry["read_ratio"] == 1.0
    _, small = _run(engine, prompts, "quest", {"budget": 32, "page_size": 8}, new=4)
    # the 80-token prompt, 3 decode steps over 81..83 entries: 4 pages of 8 + the current page's 1..3
    assert small[0].telemetry["read_ratio"] == pytest.approx((33 + 34 + 35) / (81 + 82 + 83), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# padding, stacking, options


@pytest.mark.parametrize("spec,opts,bound", [
    ("h2o", {"budget": 24, "interval": 3}, 24 + 3 - 1),
    ("snapkv", {"budget": 24, "window": 4}, 24 + 6),
    ("quest", {"budget": 16, "page_size": 4}, None),
    ("quest+streamingllm", {"budget": 24}, 24),
])
def test_padding_is_never_attended_and_cache_stays_in_budget(engine, spec, opts, bound):
    """A sequence decodes the same alone and next to a longer one (its pad rows/entries unseen);
    an eviction policy's cache never holds more than its bound (budget + interval - 1 after a step)."""
    long, short = _prompt(engine, 64), _prompt(engine, 37)
    _, both = _run(engine, [long, short], spec, opts, new=6)
    _, alone = _run(engine, [short], spec, opts, new=6)
    assert both[1].token_ids == alone[0].token_ids
    if bound is not None:
        per_entry = 2 * engine.info.num_kv_heads * engine.info.head_dim * 4 * engine.info.num_layers
        # peaks are taken before compactions: the 64-token prompt, then at most bound + 1 per step
        assert both[0].telemetry["kv_bytes_peak"] == max(64, bound + 1) * per_entry
        assert both[0].telemetry["kv_bytes_final"] <= bound * per_entry
        assert both[0].telemetry["evicted_tokens"] > 0


def test_bad_options_and_conflicting_stacks_are_refused(engine):
    with pytest.raises(PolicyError, match="budget"):
        build_policy("snapkv", {"budget": 16, "window": 32})
    with pytest.raises(PolicyError, match="exceeds budget"):
        build_policy("streamingllm", {"budget": 16, "sinks": 4, "recent": 20})
    with pytest.raises(PolicyError, match="pooling"):
        build_policy("snapkv", {"pooling": "median"})
    for spec in ("quest+h2o", "h2o+quest"):  # either order: one of the two would never see attention
        with pytest.raises(PolicyError, match="cannot be stacked"):
            _run(engine, [_prompt(engine, 20)], spec, {}, new=1)
    stack = build_policy("h2o+quest", {"budget": 512})  # one option, both parts
    assert [p.config.budget for p in stack.parts] == [512, 512]

