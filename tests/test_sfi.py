"""SFI policy: fast/slow attention against references, trigger logic, exactness in the engine when
sink + K + recent covers the context, telemetry, options through the registry."""

from __future__ import annotations

import json

import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.policies.base import grouped_attention
from cotserve.policies.registry import build_policy, parse_options
from cotserve.policies.sfi import RefreshTrigger, SFIConfig
from cotserve.policies.sfi.attention import fast_attention, fast_attention_reference, slow_attention
from cotserve.policies.sfi.fallback import (
    page_bound_attention,
    page_bound_reference,
    page_bounds,
    page_scores,
)
from cotserve.policies.sfi.policy import mask_rows_inplace, select_positions

# -- attention ------------------------------------------------------------------------------


def test_fast_attention_equals_reference_over_the_same_positions():
    g = torch.Generator().manual_seed(0)
    b, hkv, grp, d, s, sinks, k, recent = 3, 2, 3, 16, 60, 2, 12, 10
    q = torch.randn(b, hkv * grp, 1, d, generator=g)
    kc = torch.randn(b, hkv, s, d, generator=g)
    vc = torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([60, 55, 48])  # ragged slots
    ck = torch.zeros(b, hkv, sinks + k, d)
    cv = torch.zeros_like(ck)
    cpos = torch.full((b, hkv, sinks + k), -1)
    for bi in range(b):
        n = int(lens[bi])
        for h in range(hkv):
            # selected positions per head, some of them inside the current recent window
            sel = torch.randperm(n - sinks, generator=g)[: k - bi].sort().values + sinks
            idx = torch.cat([torch.arange(sinks), sel])
            ck[bi, h, : len(idx)] = kc[bi, h, idx]
            cv[bi, h, : len(idx)] = vc[bi, h, idx]
            cpos[bi, h, : len(idx)] = idx
    wstart = (lens - recent).clamp_min(0)
    lo, hi = int(wstart.min()), int(lens.max())
    ar = torch.arange(lo, hi)
    wmask = ((ar >= wstart[:, None]) & (ar < lens[:, None])).unsqueeze(1)
    cmask = (cpos >= 0) & (cpos < wstart.view(-1, 1, 1))
    out = fast_attention(q, ck.transpose(-1, -2).contiguous(), cv, cmask, kc[:, :, lo:hi], vc[:, :, lo:hi], wmask, 0.25)
    read = torch.zeros(b, hkv, s, dtype=torch.bool)
    for bi in range(b):
        for h in range(hkv):
            read[bi, h, cpos[bi, h][cpos[bi, h] >= 0]] = True
            read[bi, h, int(wstart[bi]) : int(lens[bi])] = True
    ref = fast_attention_reference(q, kc, vc, read, 0.25)
    assert torch.allclose(out, ref, atol=1e-5)
    # a position both selected and recent is read once: reading it twice would change the output
    twice = fast_attention(q, ck.transpose(-1, -2).contiguous(), cv, cpos >= 0, kc[:, :, lo:hi], vc[:, :, lo:hi], wmask, 0.25)
    assert not torch.allclose(twice, ref, atol=1e-4)


def _kernel_layout(ck: torch.Tensor) -> torch.Tensor:
    """[B, H, C, D] -> the C++ kernel's blocked keys [B, H, C / 16, D, 16] (C padded to 16)."""
    b, h, c, d = ck.shape
    pad = -(-c // 16) * 16
    full = ck.new_zeros(b, h, pad, d)
    full[:, :, :c] = ck
    return full.view(b, h, pad // 16, 16, d).transpose(-1, -2).contiguous()


@pytest.mark.parametrize(("grp", "d", "c_dtype"), [(3, 64, torch.float32), (3, 64, torch.bfloat16),
                                                    (4, 128, torch.bfloat16), (2, 16, torch.float32),
                                                    (5, 24, torch.bfloat16)])
def test_cpu_kernel_equals_reference_on_random_inputs(grp, d, c_dtype):
    """The C++ fast step (compile-time and generic shapes) against the plain reference: ragged
    windows, masked compact entries, a slot with an empty window, a head with nothing compact.
    A bf16 compact buffer is compared with the reference over the same bf16-rounded entries."""
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(grp * d)
    b, hkv, s, c = 3, 2, 90, 37
    q = torch.randn(b, hkv * grp, 1, d, generator=g)
    kc = torch.randn(b, hkv, s, d, generator=g)
    vc = torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([90, 70, 40])
    wstart = torch.tensor([70, 58, 40])  # slot 2: empty window
    idx = torch.stack([torch.stack([torch.randperm(int(wstart[i]), generator=g)[:c] for _ in range(hkv)])
                       for i in range(b)])  # [B, H, C]
    cmask = torch.rand(b, hkv, c, generator=g) > 0.2
    cmask[1, 0] = False  # nothing compact for this head
    cmask[2, 1] = False  # ... and for this one nothing at all (slot 2's window is empty): zeros
    ck = torch.gather(kc, 2, idx.unsqueeze(-1).expand(-1, -1, -1, d)).to(c_dtype)
    cv = torch.gather(vc, 2, idx.unsqueeze(-1).expand(-1, -1, -1, d)).to(c_dtype)
    pad = -(-c // 16) * 16
    cmask_p = torch.zeros(b, hkv, pad, dtype=torch.bool)
    cmask_p[:, :, :c] = cmask
    cv_p = cv.new_zeros(b, hkv, pad, d)
    cv_p[:, :, :c] = cv
    out = cpu_decode.two_source_decode(q.view(b, hkv, grp, d), _kernel_layout(ck), cv_p, cmask_p, kc, vc, wstart,
                                       lens, 0.3)
    # reference: the same entries (bf16-rounded where stored so), read once each
    kr, vr = kc.clone(), vc.clone()
    read = torch.zeros(b, hkv, s, dtype=torch.bool)
    for bi in range(b):
        for h in range(hkv):
            sel = idx[bi, h][cmask[bi, h]]
            kr[bi, h, sel] = ck[bi, h][cmask[bi, h]].float()
            vr[bi, h, sel] = cv[bi, h][cmask[bi, h]].float()
            read[bi, h, sel] = True
            read[bi, h, int(wstart[bi]) : int(lens[bi])] = True
    ref = fast_attention_reference(q, kr, vr, read, 0.3)
    assert torch.allclose(out.view(b, hkv * grp, 1, d), ref, atol=1e-5)
    assert torch.equal(out[2, 1], torch.zeros(grp, d))


def test_slow_attention_is_dense_for_the_current_row_and_returns_all_rows_logits():
    g = torch.Generator().manual_seed(1)
    hkv, grp, w, s, d = 3, 3, 4, 40, 8
    qrows = torch.randn(hkv * grp, w, d, generator=g)
    k = torch.randn(hkv, s, d, generator=g)
    v = torch.randn(hkv, s, d, generator=g)
    out, logits = slow_attention(qrows, 2, k, v, 0.3)
    ref = grouped_attention(qrows[None, :, 2:3], k[None], v[None], None, 0.3)[0]
    assert torch.allclose(out, ref, atol=1e-5)
    assert logits.shape == (hkv, grp, w, s)
    assert torch.allclose(logits[1, 2, 3], (k[1] @ qrows[1 * grp + 2, 3]) * 0.3, atol=1e-5)


def test_selector_pipeline_keeps_sinks_out_and_caps_k():
    g = torch.Generator().manual_seed(2)
    h, r, s = 3, 6, 50
    cfg = SFIConfig(sinks=4, k=10)
    logits = torch.randn(h, r, s, generator=g)
    logits[:, :, 20] += 8  # a strong position
    allowed = torch.ones(h, r, s, dtype=torch.bool)
    pos = torch.arange(s).expand(h, s)
    idx = select_positions(cfg, logits, allowed, pos, torch.rand(h, s, generator=g) + 0.5, now=s - 1)
    assert idx.shape == (h, 10) and int(idx.min()) >= 4 and (idx == 20).any(-1).all()
    small = select_positions(SFIConfig(sinks=4, k=100), logits, allowed, pos, torch.ones(h, s), now=s - 1)
    assert small.shape == (h, s - 4) and torch.equal(small[0], torch.arange(4, s))


def test_inplace_row_masking_matches_the_explicit_allowed_mask():
    g = torch.Generator().manual_seed(3)
    h, grp, r, s, sinks = 3, 3, 5, 40, 4
    logits = torch.randn(h, grp, r, s, generator=g)
    pos = torch.arange(s).expand(h, s)
    row_pos = torch.tensor([35, 36, 37, 38, 39])
    allowed = (pos.unsqueeze(1) <= row_pos.view(1, r, 1)) & (pos.unsqueeze(1) >= sinks)  # [H, R, S]
    allowed = allowed.unsqueeze(1).expand(h, grp, r, s).reshape(h, grp * r, s)
    cfg = SFIConfig(sinks=sinks, k=9)
    want = select_positions(cfg, logits.reshape(h, grp * r, s), allowed, pos, torch.ones(h, s), now=39)
    masked = logits.clone()
    mask_rows_inplace(masked, pos, row_pos, sinks)
    assert torch.isinf(masked[..., :sinks]).all() and torch.isinf(masked[:, :, 0, 36:]).all()
    assert torch.isfinite(masked[:, :, 0, sinks:36]).all() and torch.isfinite(masked[:, :, -1, sinks:]).all()
    got = select_positions(cfg, masked.reshape(h, grp * r, s), None, pos, torch.ones(h, s), now=39)
    assert torch.equal(got, want)


# -- trigger --------------------------------------------------------------------------------


def _fires(trig: RefreshTrigger, boundaries_after: set[int], steps: int) -> list[int]:
    return [t for t in range(steps) if trig.step(t, t in boundaries_after)]


def test_trigger_fires_on_the_first_token_after_a_boundary():
    trig = RefreshTrigger("boundary", min_gap=4, max_interval=100, cooldown=2)
    assert _fires(trig, {10, 30}, 40) == [10, 30]


def test_trigger_min_gap_defers_and_cooldown_drops():
    trig = RefreshTrigger("boundary", min_gap=6, max_interval=100, cooldown=2)
    # boundary at 10 fires; 11 and 12 are within the cooldown (dropped); 14 is pending until 16
    assert _fires(trig, {10, 11, 12, 14}, 30) == [10, 16]
    trig = RefreshTrigger("boundary", min_gap=6, max_interval=100, cooldown=2)
    assert _fires(trig, {10, 11, 12}, 30) == [10]  # a run of boundary tokens: one refresh


def test_trigger_max_interval_forces_and_ablations():
    trig = RefreshTrigger("boundary", min_gap=4, max_interval=10, cooldown=1)
    assert _fires(trig, set(), 35) == [9, 19, 29]  # bootstrap counts as a refresh at -1
    trig = RefreshTrigger("boundary", min_gap=4, max_interval=10, cooldown=1)
    assert _fires(trig, {5}, 30) == [5, 15, 25]
    assert _fires(RefreshTrigger("fixed_periodic", period=7), {3, 4, 5}, 30) == [6, 13, 20, 27]
    assert _fires(RefreshTrigger("disabled", max_interval=2), {3, 4, 5}, 30) == []


# -- engine ---------------------------------------------------------------------------------


def _run(engine, prompts, policy, options=None, forced=None, n=24):
    reqs = [GenRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), record_logprobs=True,
                       forced_ids=None if forced is None else forced[i]) for i, p in enumerate(prompts)]
    return engine.generate(reqs, policy, options)


PROMPTS = [
    "Prove that the square root of two is irrational. Be careful. Use a contradiction.",
    "List three prime numbers. Then add them. What is the sum?",
]


def test_sfi_equals_dense_when_sink_k_recent_cover_the_context(engine):
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    dense = _run(engine, prompts, "dense")
    forced = [r.token_ids for r in dense]
    # tiny recent window + k covering everything + frequent refreshes: every step mixes compact and
    # window reads, and slow steps happen, yet the logits must be dense's
    opts = {"recent": 6, "k": 4096, "sinks": 4, "max_interval": 5, "min_gap": 2, "cooldown": 1}
    sfi = _run(engine, prompts, "sfi", opts, forced)  # the C++ fast step where it builds
    sfi_torch = _run(engine, prompts, "sfi", {**opts, "kernel": "torch"}, forced)
    for d, s in [*zip(dense, sfi, strict=True), *zip(dense, sfi_torch, strict=True)]:
        assert s.token_ids == d.token_ids
        assert s.greedy_ids == d.greedy_ids
        assert float((d.logprobs - s.logprobs).abs().max()) < 1e-3  # float32 log-probs, whole vocabulary
        tele = s.telemetry
        assert tele["sfi_slow_steps"] >= 3 and tele["sfi_steps"] == len(d.token_ids) - 1
        assert tele["sfi_retained_ratio"] == 1.0
    # the same with a sparse budget really reads less, and differs
    sparse = _run(engine, prompts, "sfi", {"recent": 6, "k": 8, "max_interval": 6}, forced)
    for s in sparse:
        assert 0.0 < s.telemetry["sfi_retained_ratio"] < 0.9
        assert 0.0 < s.telemetry["sfi_slow_step_ratio"] < 0.5
    assert any((d.logprobs.float() - s.logprobs.float()).abs().max() > 0.05 for d, s in zip(dense, sparse, strict=True))


def test_kernel_and_torch_fast_steps_agree_in_the_engine(engine):
    """A sparse SFI decode through the C++ fast step equals the torch one (same tokens, logprobs
    to float rounding); a bf16 compact buffer stays close to the float32 one."""
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    forced = [r.token_ids for r in _run(engine, prompts, "dense")]
    sparse = {"recent": 6, "k": 8, "max_interval": 6}
    stacks = {name: build_policy("sfi", {**sparse, **extra}) for name, extra in
              (("kern", {}), ("torch", {"kernel": "torch"}), ("bf16", {"compact_dtype": "bfloat16"}))}
    kern, torch_path, bf16 = (_run(engine, prompts, stacks[name], forced=forced) for name in ("kern", "torch", "bf16"))
    assert [stacks[n].parts[0].describe() for n in ("kern", "torch", "bf16")] == [
        {"fast_step": "cpu_kernel", "compact_dtype": "float32"}, {"fast_step": "torch", "compact_dtype": "float32"},
        {"fast_step": "cpu_kernel", "compact_dtype": "bfloat16"}]
    for a, t, h in zip(kern, torch_path, bf16, strict=True):
        assert a.greedy_ids == t.greedy_ids
        assert float((a.logprobs - t.logprobs).abs().max()) < 1e-3
        assert (a.logprobs.float().exp() - h.logprobs.float().exp()).abs().max() < 0.05
        sfi_keys = [k for k in a.telemetry if k.startswith("sfi_")]
        assert sfi_keys and all(a.telemetry[k] == t.telemetry[k] for k in sfi_keys)


def test_dense_head_fallback_reads_the_whole_history(engine):
    """The unstable-head fallback: with every head allowed to fall back (and a threshold of 0),
    a sparse SFI must give dense's logits; with the default fraction only that many heads do."""
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    dense = _run(engine, prompts, "dense")
    forced = [r.token_ids for r in dense]
    # the windows the fallback was built with (its instability score compares several query rows)
    sparse = {"recent": 6, "k": 8, "max_interval": 6, "obs_window": 8, "prefill_window": 8, "min_gap": 32, "cooldown": 4}
    every = _run(engine, prompts, "sfi", {**sparse, "dense_heads": 1.0, "dense_min": 0.0}, forced)
    for d, s in zip(dense, every, strict=True):
        assert s.greedy_ids == d.greedy_ids
        assert float((d.logprobs - s.logprobs).abs().max()) < 1e-3  # float32 log-probs, whole vocabulary
        assert s.telemetry["sfi_dense_head_ratio"] == 1.0 and s.telemetry["sfi_retained_ratio"] == 1.0
    # the exact path (dense_budget=0) too; a small page budget reads less than everything
    exact = _run(engine, prompts, "sfi", {**sparse, "dense_heads": 1.0, "dense_min": 0.0, "dense_budget": 0}, forced)
    paged = _run(engine, prompts, "sfi", {**sparse, "dense_heads": 1.0, "dense_min": 0.0, "dense_budget": 8,
                                          "dense_page": 4}, forced)
    for d, s, p in zip(dense, exact, paged, strict=True):
        assert float((d.logprobs - s.logprobs).abs().max()) < 1e-3  # float32 log-probs, whole vocabulary
        assert s.telemetry["sfi_retained_ratio"] == 1.0
        assert 0.0 < p.telemetry["sfi_retained_ratio"] < 0.95
    few = _run(engine, prompts, "sfi", {**sparse, "dense_heads": 0.1, "dense_min": 0.0}, forced)
    none = _run(engine, prompts, "sfi", {**sparse, "dense_heads": 0.0}, forced)

    def kl(ref, got) -> float:  # mean KL(dense || policy) over the steps
        p, q = ref.logprobs.float(), got.logprobs.float()
        return float((p.exp() * (p - q)).sum(-1).mean())

    for d, f, z, p in zip(dense, few, none, paged, strict=True):
        assert 0.0 < f.telemetry["sfi_dense_head_ratio"] <= 0.1 + 1e-6
        assert z.telemetry["sfi_dense_head_ratio"] == 0.0
        assert f.telemetry["sfi_retained_ratio"] > z.telemetry["sfi_retained_ratio"]
        assert p.telemetry["sfi_retained_ratio"] > z.telemetry["sfi_retained_ratio"]
        # the page reads of every head track dense more closely than the plain sparse selection
        assert kl(d, p) < kl(d, z)


@pytest.mark.parametrize(("n", "budget", "page", "sinks"),
                         [(200, 48, 16, 4), (200, 1000, 16, 4), (37, 16, 8, 4), (130, 8, 4, 4), (130, 8, 4, 10),
                          (30, 16, 16, 4), (20, 16, 8, 4)])
def test_page_bound_fallback_read_matches_its_loop_reference(n, budget, page, sinks):
    """A fallback head's Quest read (page bounds, top pages, the pages holding the sinks, tail)
    against loops; also with no full page before the window (everything is read)."""
    g = torch.Generator().manual_seed(n + budget + sinks)
    d = 8
    k = torch.randn(n, d, generator=g)
    v = torch.randn(n, d, generator=g)
    q = torch.randn(3, 1, d, generator=g)
    pages = max(0, n - 20) // page
    bounds = page_bounds(k[: pages * page], page)
    assert bounds.shape == (2 * d, pages)
    out, read = page_bound_attention(q, k, v, bounds, budget, page, 0.3, sinks)
    assert torch.allclose(out, page_bound_reference(q, k, v, pages, budget, page, 0.3, sinks), atol=1e-5)
    first = -(-sinks // page)
    take = min(max(budget // page, first), pages)
    assert read == (n if take >= pages else take * page + n - pages * page)
    # the bound is an upper bound: no key of a page scores above it, for any query head
    scores = page_scores(q[:, 0], bounds)
    for p in range(pages):
        assert float((k[p * page : (p + 1) * page] @ q[:, 0].T).max()) <= float(scores[p]) + 1e-5


@pytest.mark.parametrize(("grp", "d"), [(3, 64), (2, 16)])
def test_cpu_kernel_page_reads_equal_the_torch_page_read(grp, d):
    """The C++ fallback read of several heads in one call (different slots, lengths and page
    counts; a head with fewer pages than the budget reads everything; one with no full page)
    equals `page_bound_attention` head by head."""
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(7 + d)
    slots, heads, cap, page = 3, 2, 160, 4
    k = torch.randn(slots, heads, cap, d, generator=g)
    v = torch.randn(slots, heads, cap, d, generator=g)
    lens = torch.tensor([150, 97, 18])
    cases = [(0, 1, 30), (1, 0, 20), (2, 1, 0), (0, 0, 33)]  # (slot, head, bounded pages)
    for budget, sinks in ((48, 4), (48, 6), (4, 1), (1000, 4)):
        q = torch.randn(len(cases), grp, d, generator=g)
        bounds = [page_bounds(k[b, h, : p * page], page) for b, h, p in cases]
        sl = torch.tensor([c[0] for c in cases])
        hd = torch.tensor([c[1] for c in cases])
        got = cpu_decode.page_bound_decode(q, k, v, sl, hd, lens[sl], bounds, budget, page, sinks, 0.3)
        for i, (b, h, _) in enumerate(cases):
            n = int(lens[b])
            want, _ = page_bound_attention(q[i, :, None], k[b, h, :n], v[b, h, :n], bounds[i], budget, page, 0.3,
                                           sinks)
            assert torch.allclose(got[i], want[:, 0], atol=1e-5), (budget, sinks, i)


def test_page_bound_fallback_finds_a_retrieved_key_far_back():
    """One key far back matches the query strongly: with room for two pages (sinks + one), the
    page read takes that page and the output is (nearly) its value, as dense attention's is."""
    g = torch.Generator().manual_seed(5)
    n, d, page = 300, 16, 8
    k = torch.randn(n, d, generator=g) * 0.1
    v = torch.randn(n, d, generator=g)
    q = torch.randn(2, 1, d, generator=g)
    k[101] = q[0, 0] * 4.0  # inside page 12
    pages = (n - 40) // page
    out, read = page_bound_attention(q, k, v, page_bounds(k[: pages * page], page), 2 * page, page, 1.0)
    dense = grouped_attention(q[None], k[None, None], v[None, None], None, 1.0)[0]
    assert read == 2 * page + n - pages * page
    assert torch.allclose(out[0], dense[0], atol=1e-3)
    assert torch.allclose(out[0, 0], v[101], atol=0.05)


def test_sfi_trigger_ablations_in_the_engine(engine):
    prompts = [engine.encode_prompt(PROMPTS[1])]
    off = _run(engine, prompts, "sfi", {"trigger": "disabled", "k": 8, "recent": 8}, n=16)[0]
    assert off.telemetry["sfi_slow_steps"] == 0
    per = _run(engine, prompts, "sfi", {"trigger": "fixed_periodic", "period": 5, "k": 8, "recent": 8}, n=16)[0]
    assert per.telemetry["sfi_slow_steps"] == 3  # steps 4, 9, 14 of 15


# -- options --------------------------------------------------------------------------------


def test_options_parse_through_the_registry(tmp_path):
    stack = build_policy("sfi", parse_options(["k=1024", "recent=128", "trigger=fixed_periodic", "sfi.alpha=0"]))
    (p,) = stack.parts
    assert (p.config.k, p.config.recent, p.config.trigger, p.config.alpha) == (1024, 128, "fixed_periodic", 0.0)
    f = tmp_path / "o.json"
    f.write_text(json.dumps({"sfi": {"k": 512, "fusion": "linear", "lam": 0.3}}))
    (p,) = build_policy("sfi", parse_options(["sfi.sinks=2"], str(f))).parts
    assert (p.config.k, p.config.fusion, p.config.lam, p.config.sinks) == (512, "linear", 0.3, 2)
    y = tmp_path / "o.yaml"
    y.write_text("sfi:\n  min_gap: 3\n  max_interval: 9\n")
    (p,) = build_policy("sfi", parse_options(None, str(y))).parts
    assert (p.config.min_gap, p.config.max_interval) == (3, 9)
    for bad in (["trigger=sometimes"], ["k=0"], ["fusion=max"], ["k=lots"], ["nosuch=1"], ["brake=0"],
                ["dense_heads=1.5"], ["dense_min=-0.1"], ["dense_budget=-1"], ["dense_page=0"]):
        with pytest.raises(PolicyError):
            build_policy("sfi", parse_options(bad))


def test_cached_key_norms_follow_a_compaction():
    """SFI caches ||k|| per entry; when an eviction policy compacts a row, the cache must not keep
    the norms of the entries that used to sit at those indices."""
    from cotserve.kv.cache import CacheShape, KVCache
    from cotserve.policies.sfi.policy import SFIPolicy

    g = torch.Generator().manual_seed(4)
    cache = KVCache(CacheShape(layers=2, slots=1, kv_heads=2, capacity=32, head_dim=8), torch.float32,
                    torch.device("cpu"))
    cache.k[:, 0, :, :20] = torch.randn(2, 2, 20, 8, generator=g)
    cache.pos[:, 0, :, :20] = torch.arange(20)
    cache.lens[:, 0] = 20
    pol = SFIPolicy(SFIConfig())
    pol.knorm = torch.zeros(2, 1, 2, 32)
    pol.knorm_upto = [[0], [0]]
    pol.knorm_epoch = [[0], [0]]
    pol.n_layers = 2
    got = pol._key_norms(slice(None), [0, 1], 0, 20, cache)
    assert torch.allclose(got, cache.k[:, 0, :, :20].norm(dim=-1))
    cache.compact(1, 0, torch.arange(0, 20, 2).expand(2, 10))  # layer 1 keeps every other entry
    got = pol._key_norms(slice(None), [0, 1], 0, 10, cache)
    assert torch.allclose(got, cache.k[:, 0, :, :10].norm(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_kernel_equals_the_torch_gather(dtype):
    """`cpu_decode.pack_compact` (SFI's re-pack under the C++ kernel) writes exactly what gathering
    the rows with torch and laying them out in blocks of 16 writes: keys of the chosen layers and
    heads (the entries after m repeat row 0), values (converted to the buffer's dtype), nothing
    else of the buffers touched."""
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(5)
    L, B, H, S, D, C = 4, 3, 2, 50, 64, 32  # noqa: N806
    k, v = torch.randn(L, B, H, S, D, generator=g), torch.randn(L, B, H, S, D, generator=g)
    ckt = torch.randn(L, B, H, C // 16, D, 16, generator=g).to(dtype)
    cv = torch.randn(L, B, H, C, D, generator=g).to(dtype)
    layers, slot, m = [0, 2, 3], 1, 21
    keys = torch.stack([torch.stack([torch.randperm(S, generator=g)[:m] for _ in range(H)]) for _ in layers])
    want_k, want_v = ckt.clone(), cv.clone()
    for i, layer in enumerate(layers):
        for h in range(H):
            rows = torch.cat([keys[i, h], keys[i, h, :1].expand(C - m)])
            want_k[layer, slot, h] = k[layer, slot, h, rows].view(C // 16, 16, D).transpose(-1, -2).to(dtype)
            want_v[layer, slot, h, :m] = v[layer, slot, h, keys[i, h]].to(dtype)
    cpu_decode.pack_compact(k, v, slot, keys, torch.tensor(layers), ckt, cv)
    assert torch.equal(ckt, want_k) and torch.equal(cv, want_v)
    with pytest.raises(RuntimeError, match="rows outside the cache"):
        cpu_decode.pack_compact(k, v, slot, keys + S, torch.tensor(layers), ckt, cv)


@pytest.mark.parametrize(("grp", "d", "alpha"), [(3, 64, 0.5), (4, 128, 1.0), (5, 24, 0.3)])
def test_fused_slow_step_equals_slow_attention_and_evidence(grp, d, alpha):
    """`cpu_decode.two_source_decode_evidence`, SFI's slow step fused into the kernel call: its
    slow slots get dense attention (the torch `slow_attention` to float rounding, and the very
    arithmetic of the dense policy's kernel step, bit for bit) and the evidence of the current
    query (`selector.evidence_and_instability` on the sink-masked logits, to float rounding);
    the other slots get exactly `two_source_decode`'s fast step, their evidence rows untouched."""
    from cotserve.kernels import cpu_decode
    from cotserve.policies import selector as sel

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(grp + d)
    b, hkv, s, c, sinks = 3, 2, 90, 32, 4
    q = torch.randn(b, hkv, grp, d, generator=g)
    kc = torch.randn(b, hkv, s, d, generator=g)
    vc = torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([90, 70, 61])
    wstart = torch.tensor([70, 58, 40])
    ck = _kernel_layout(torch.randn(b, hkv, c, d, generator=g).to(torch.bfloat16))
    cv = torch.randn(b, hkv, c, d, generator=g).to(torch.bfloat16)
    cmask = torch.rand(b, hkv, c, generator=g) > 0.3
    slow = torch.tensor([True, False, True])
    f = torch.full((b, hkv, s), 7.0)
    out = cpu_decode.two_source_decode_evidence(q, ck, cv, cmask, kc, vc, wstart, lens, 0.3, slow, f, sinks, alpha)
    fast = cpu_decode.two_source_decode(q, ck, cv, cmask, kc, vc, wstart, lens, 0.3)
    assert torch.equal(out[1], fast[1])
    assert torch.equal(f[1], torch.full((hkv, s), 7.0))
    no_compact = (ck[:, :, :0], cv[:, :, :0], cmask[:, :, :0])
    dense = cpu_decode.two_source_decode(q, *no_compact, kc, vc, torch.zeros(b, dtype=torch.long), lens, 0.3)
    for bi in (0, 2):
        n = int(lens[bi])
        assert torch.equal(out[bi], dense[bi])
        o, logits = slow_attention(q[bi].reshape(hkv * grp, 1, d), 0, kc[bi, :, :n], vc[bi, :, :n], 0.3)
        assert torch.allclose(out[bi], o.view(hkv, grp, d), atol=1e-5)
        logits[..., :sinks] = float("-inf")
        want, _ = sel.evidence_and_instability(logits, alpha, 8, 4, 0, False)
        assert torch.allclose(f[bi, :, :n], want, rtol=1e-4, atol=1e-7), (f[bi, :, :n] - want).abs().max()
        assert torch.equal(f[bi, :, :sinks], torch.zeros(hkv, sinks))
        assert torch.allclose(f[bi, :, :n].sum(-1), torch.ones(hkv))
        assert torch.equal(f[bi, :, n:], torch.full((hkv, s - n), 7.0))


def test_fused_slow_step_runs_for_the_paper_defaults_and_selects_as_the_torch_path():
    """With the kernel the paper's defaults (one observation row, no fallback heads) take the
    fused slow step; the entries it packs after a refresh are the unfused torch path's (the same
    selection up to float rounding: compared here on a prompt where no score is that close)."""
    from cotserve.kernels import cpu_decode
    from cotserve.kv.batch import BatchState, ModelInfo
    from cotserve.kv.cache import CacheShape, KVCache
    from cotserve.policies.base import PolicyStack
    from cotserve.policies.sfi.policy import SFIPolicy

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(11)
    L, B, H, HQ, D, N, CAP = 2, 2, 2, 6, 16, 300, 320  # noqa: N806
    cache = KVCache(CacheShape(layers=L, slots=B, kv_heads=H, capacity=CAP, head_dim=D), torch.float32,
                    torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.pos[...] = torch.arange(CAP)
    cache.lens[...] = N + 1
    info = ModelInfo(num_layers=L, num_heads=HQ, num_kv_heads=H, head_dim=D, hidden_size=HQ * D, max_positions=CAP)
    q = torch.randn(L, B, HQ, 1, D, generator=g)
    cpos = {}
    for kernel in ("auto", "torch"):
        pol = SFIPolicy(SFIConfig(k=40, recent=16, kernel=kernel))
        batch = BatchState(info=info, cache=cache, policy=PolicyStack([pol]), scaling=D ** -0.5,
                           prompt_lens=torch.full((B,), N), tokens=[[0] * (N + 1) for _ in range(B)], mode="decode",
                           step=1, positions=torch.full((B,), N))
        pol.begin(batch)
        assert pol.fused_slow == (kernel == "auto")
        for trig, slow in zip(pol.triggers, (True, False), strict=True):
            trig.step = lambda t, after, s=slow: s
        outs = [pol.decode_attention(layer, q[layer], batch) for layer in range(L)]
        cpos[kernel] = (pol.cpos[:, 0].clone(), outs)
    m = 4 + 40  # sinks + k entries (the kernel's buffers are padded to 16 entries: -1 after)
    assert torch.equal(cpos["auto"][0][..., :m], cpos["torch"][0][..., :m])
    assert torch.all(cpos["auto"][0][..., m:] == -1) and torch.all(cpos["torch"][0] >= 0)
    for a, t in zip(cpos["auto"][1], cpos["torch"][1], strict=True):
        assert torch.allclose(a[0], t[0], atol=1e-5)  # the slow slot: dense attention either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_incremental_pack_holds_the_chosen_rows_and_moves_only_new_ones(dtype):
    """`cpu_decode.pack_compact_update`: after each of three selections the buffers hold exactly
    the chosen rows (each entry's key and value are its cache row, converted as `.to` converts;
    cidx names it), rows chosen again stay in their entry, entries holding nothing are -1; the
    fast step over the result equals the one over `pack_compact`'s ordered buffers to rounding."""
    from cotserve.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(9)
    L, B, H, S, D, C = 3, 2, 2, 120, 16, 48  # noqa: N806
    k, v = torch.randn(L, B, H, S, D, generator=g), torch.randn(L, B, H, S, D, generator=g)
    ckt = torch.zeros(L, B, H, C // 16, D, 16, dtype=dtype)
    cv = torch.zeros(L, B, H, C, D, dtype=dtype)
    cidx = torch.full((L, B, H, C), -1, dtype=torch.long)
    layers, slot = torch.tensor([0, 2]), 1
    prev = None
    for m, keep in ((40, 0), (45, 30), (33, 20)):
        keys = []
        for i in range(len(layers)):
            rows = []
            for h in range(H):
                kept = [] if prev is None else prev[i][h][:keep]
                rest = [r for r in torch.randperm(S, generator=g).tolist() if r not in kept][: m - len(kept)]
                rows.append(sorted(kept + rest))
            keys.append(rows)
        kt = torch.tensor(keys)
        before = cidx.clone()
        cpu_decode.pack_compact_update(k, v, slot, kt, layers, ckt, cv, cidx)
        for i, layer in enumerate(layers.tolist()):
            for h in range(H):
                ci = cidx[layer, slot, h]
                held = ci[ci >= 0]
                assert sorted(held.tolist()) == keys[i][h]
                for c in (ci >= 0).nonzero().flatten().tolist():
                    assert torch.equal(ckt[layer, slot, h, c // 16, :, c % 16], k[layer, slot, h, ci[c]].to(dtype))
                    assert torch.equal(cv[layer, slot, h, c], v[layer, slot, h, ci[c]].to(dtype))
                stayed = (before[layer, slot, h] >= 0) & torch.isin(before[layer, slot, h], kt[i, h])
                assert torch.equal(ci[stayed], before[layer, slot, h][stayed])
        assert torch.all(cidx[1] == -1) and torch.all(cidx[:, 0] == -1)  # other layers and slots untouched
        prev = keys
    # the fast step over the permuted buffers against pack_compact's ascending ones
    ckt2, cv2 = torch.zeros_like(ckt), torch.zeros_like(cv)
    cpu_decode.pack_compact(k, v, slot, kt, layers, ckt2, cv2)
    m = kt.shape[-1]
    q = torch.randn(B, H, 3, D, generator=g)
    ws, we = torch.tensor([110, 110]), torch.tensor([S, S])
    for layer in layers.tolist():
        mask_a = cidx[layer] >= 0
        mask_b = torch.zeros(B, H, C, dtype=torch.bool)
        mask_b[slot, :, :m] = True
        a = cpu_decode.two_source_decode(q, ckt[layer], cv[layer], mask_a, k[layer], v[layer], ws, we, 0.25)
        o = cpu_decode.two_source_decode(q, ckt2[layer], cv2[layer], mask_b, k[layer], v[layer], ws, we, 0.25)
        assert torch.allclose(a[slot], o[slot], atol=1e-5)
