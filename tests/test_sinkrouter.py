"""SinkRouter (policy level): routing, the read-skipping fast path against its reference, first
layers, telemetry, calibration files and refusals. Random inputs on a real KVCache; no model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cotserve.errors import PolicyError
from cotserve.kv.batch import BatchState, ModelInfo
from cotserve.kv.cache import CacheShape, KVCache
from cotserve.policies.base import PolicyStack, dense_decode
from cotserve.policies.registry import build_policy
from cotserve.policies.sinkrouter import (
    Calibration,
    SinkRouterConfig,
    SinkRouterPolicy,
    TauFit,
    routing_score,
    sinkrouter_decode,
    sinkrouter_decode_reference,
)
from cotserve.sinkrouter_calibration import average_precision, fit_platt

LAYERS, HQ, HKV, D = 4, 6, 3, 16


class RecordingCache(KVCache):
    """Instrumentation: a real KVCache that records which (layer, slot, kv_head) rows were read.
    `view` reads every row of the layer; `read_rows` only the rows it names."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reads: set[tuple[int, int, int]] = set()

    def view(self, layer, upto=None):
        for b in range(self.shape.slots):
            for h in range(self.shape.kv_heads):
                self.reads.add((layer, b, h))
        return super().view(layer, upto)

    def read_row(self, layer, slot, kv_head, upto):
        self.reads.add((layer, slot, kv_head))
        return super().read_row(layer, slot, kv_head, upto)

    def read_rows(self, layer, slots, kv_heads, upto):
        for b, h in zip(slots.tolist(), kv_heads.tolist(), strict=True):
            self.reads.add((layer, b, h))
        return super().read_rows(layer, slots, kv_heads, upto)


def make_batch(policy: SinkRouterPolicy, lens=(11, 7), seed=0, cache_cls=RecordingCache) -> BatchState:
    """A batch whose cache holds random prefill entries of ragged lengths, as after prefill."""
    g = torch.Generator().manual_seed(seed)
    bsz, cap = len(lens), max(lens) + 4
    cache = cache_cls(CacheShape(LAYERS, bsz, HKV, cap, D), torch.float32, torch.device("cpu"))
    info = ModelInfo(num_layers=LAYERS, num_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=HQ * D,
                     max_positions=4096, model_name="test-model")
    plen = torch.tensor(lens)
    batch = BatchState(info=info, cache=cache, policy=PolicyStack([policy]), scaling=D ** -0.5,
                       prompt_lens=plen, tokens=[[0] * n for n in lens])
    policy.begin(batch)
    t = max(lens)
    for layer in range(LAYERS):
        k = torch.randn(bsz, HKV, t, D, generator=g)
        v = torch.randn(bsz, HKV, t, D, generator=g)
        cache.write_prefill(layer, k, v, plen)
        q = torch.randn(bsz, HQ, t, D, generator=g)
        policy.prefill_attention(layer, q, k, v, batch)
    batch.mode = "decode"
    batch.active = torch.ones(bsz, dtype=torch.bool)
    batch.positions = plen.clone()
    for layer in range(LAYERS):
        cache.write_decode(layer, torch.randn(bsz, HKV, 1, D, generator=g), torch.randn(bsz, HKV, 1, D, generator=g),
                           batch.positions)
    cache.reads.clear()
    return batch


def fixed_tau_policy(tau: float, **kw) -> SinkRouterPolicy:
    """The torch paths (the read-skipping fast path these tests watch); `kernel` overrides."""
    return SinkRouterPolicy(SinkRouterConfig(tau=tau, **{"kernel": "torch", **kw}))


def test_kernel_path_matches_reference_and_is_dense_when_nothing_is_skipped():
    """kernel=auto on a CPU: few sink groups -> the dense C++ kernel for all groups, sink groups
    overwritten; none -> exactly `dense`'s kernel step; many -> the read-skipping path. All equal
    the plain reference."""
    from cotserve.kernels import cpu_decode
    from cotserve.policies.dense import kernel_dense_decode

    if not cpu_decode.available():
        pytest.skip("the CPU kernel did not build here (no compiler)")
    g = torch.Generator().manual_seed(7)
    policy = fixed_tau_policy(0.0, kernel="auto")
    batch = make_batch(policy, lens=(11, 7, 9), seed=2)
    assert policy.kernel
    for layer in range(LAYERS):
        q = torch.randn(batch.batch_size, HQ, 1, D, generator=g)
        score = routing_score("logit_min", q, policy.anchor_k[layer], batch.scaling)
        k, v, valid = batch.cache.view(layer)
        flat = score.flatten().sort().values
        for tau in (math.inf, float(flat[-2]), float(flat[0])):  # none, 2 of 9, all skipped
            policy.cfg.tau = tau
            skip = score >= tau if layer >= 2 else torch.zeros_like(score, dtype=torch.bool)
            out = policy.decode_attention(layer, q, batch)
            ref = sinkrouter_decode_reference(q, k, v, valid, skip, batch.scaling)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            if not skip.any():
                assert torch.equal(out, kernel_dense_decode(q, batch, layer))


def test_fast_path_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    for trial in range(6):
        policy = fixed_tau_policy(0.0)
        batch = make_batch(policy, lens=(5 + trial, 13, 9)[: 1 + trial % 3], seed=trial)
        b = batch.batch_size
        for layer in range(LAYERS):
            q = torch.randn(b, HQ, 1, D, generator=g)
            skip = torch.rand(b, HKV, generator=g) < 0.5
            k, v, valid = batch.cache.view(layer)
            for sur in (None, torch.randn(b, HKV, D, generator=g)):
                ref = sinkrouter_decode_reference(q, k, v, valid, skip, batch.scaling, sur)
                for gather_min_rows in (1, 10**6):  # the gathered batch and the per-row views
                    fast = sinkrouter_decode(q, batch.cache, layer, skip, batch.scaling, sur, gather_min_rows)
                    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gather_min_rows", [1, 10**6])
def test_sink_groups_output_zero_and_their_history_is_never_read(monkeypatch, gather_min_rows):
    from cotserve.policies import sinkrouter

    monkeypatch.setattr(sinkrouter, "GATHER_MIN_ROWS", gather_min_rows)
    policy = fixed_tau_policy(0.0)
    batch = make_batch(policy, lens=(11, 7, 9), seed=3)
    g = torch.Generator().manual_seed(4)
    seen_skip = seen_keep = 0
    for layer in range(2, LAYERS):
        q = torch.randn(batch.batch_size, HQ, 1, D, generator=g)
        score = routing_score("logit_min", q, policy.anchor_k[layer], batch.scaling)
        policy.cfg.tau = float(score.median())  # about half the groups are sinks
        skip = score >= policy.cfg.tau
        assert skip.any() and (~skip).any()
        batch.cache.reads.clear()
        out = policy.decode_attention(layer, q, batch)
        read = {(b, h) for (lay, b, h) in batch.cache.reads if lay == layer}
        assert read == {(b, h) for b in range(batch.batch_size) for h in range(HKV) if not skip[b, h]}
        dense = dense_decode(q, batch, layer)
        out_g = out.view(batch.batch_size, HKV, HQ // HKV, D)
        dense_g = dense.view(batch.batch_size, HKV, HQ // HKV, D)
        for b in range(batch.batch_size):
            for h in range(HKV):
                if skip[b, h]:
                    seen_skip += 1
                    assert torch.count_nonzero(out_g[b, h]) == 0
                else:
                    seen_keep += 1
                    torch.testing.assert_close(out_g[b, h], dense_g[b, h], atol=1e-5, rtol=1e-5)
    assert seen_skip and seen_keep


def test_first_layers_are_never_routed():
    policy = fixed_tau_policy(-math.inf, first_layers=2)  # every routable group is a sink
    batch = make_batch(policy)
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        q = torch.randn(batch.batch_size, HQ, 1, D, generator=g)
        batch.cache.reads.clear()
        out = batch.policy.decode_attention(layer, q, batch)
        if layer < 2:
            torch.testing.assert_close(out, dense_decode(q, batch, layer))
            assert len(batch.cache.reads) == batch.batch_size * HKV
        else:
            assert torch.count_nonzero(out) == 0
            assert not batch.cache.reads
    tele = policy.telemetry(0)
    assert tele["sinkrouter_skip_ratio"] == 1.0
    assert tele["sinkrouter_eligible_groups"] == (LAYERS - 2) * HKV


def test_never_skipping_is_dense_and_skip_ratio_counts_active_slots():
    policy = fixed_tau_policy(math.inf)
    batch = make_batch(policy)
    q = torch.randn(batch.batch_size, HQ, 1, D)
    assert policy.decode_attention(3, q, batch) is None  # falls through to the dense default
    assert policy.telemetry(1)["sinkrouter_skip_ratio"] == 0.0
    p2 = fixed_tau_policy(-math.inf)
    b2 = make_batch(p2)
    b2.active = torch.tensor([True, False])
    p2.decode_attention(3, q, b2)
    assert p2.telemetry(0)["sinkrouter_skipped_groups"] == HKV
    assert p2.telemetry(1)["sinkrouter_eligible_groups"] == 0


def test_anchor_value_surrogate_returns_token0_value_without_reading():
    policy = fixed_tau_policy(-math.inf, surrogate="anchor_value")
    batch = make_batch(policy)
    q = torch.randn(batch.batch_size, HQ, 1, D)
    out = policy.decode_attention(2, q, batch).view(batch.batch_size, HKV, HQ // HKV, D)
    v0 = batch.cache.v[2, :, :, 0]
    torch.testing.assert_close(out, v0[:, :, None, :].expand_as(out))
    assert not batch.cache.reads


def test_anchor_survives_compaction():
    """Eviction may drop token 0 from the cache; routing uses the anchor copied at prefill."""
    policy = fixed_tau_policy(0.0)
    batch = make_batch(policy, lens=(11, 7))
    anchor = batch.cache.k[3, :, :, 0].clone()
    n = int(batch.cache.lens[3, 0])
    keep = torch.arange(1, n).expand(HKV, -1)  # drop token 0 in slot 0
    batch.cache.compact(3, 0, keep)
    assert not bool((batch.cache.pos[3, 0, :, : n - 1] == 0).any())
    torch.testing.assert_close(policy.anchor_k[3], anchor)
    q = torch.randn(batch.batch_size, HQ, 1, D)
    skip = policy.route(3, q, batch)
    ref_skip = routing_score("logit_min", q, anchor, batch.scaling) >= 0.0
    assert torch.equal(skip, ref_skip)
    k, v, valid = batch.cache.view(3)
    torch.testing.assert_close(policy.decode_attention(3, q, batch) if skip.any() else dense_decode(q, batch, 3),
                               sinkrouter_decode_reference(q, k, v, valid, skip, batch.scaling), atol=1e-5, rtol=1e-5)


def _write_cal(path, **over):
    data = {"model": "test-model", "score": "logit_min", "first_layers": 2, "default_target": 0.6,
            "num_layers": LAYERS, "num_kv_heads": HKV, "norm_length": 1000,
            "fits": {"0.6": {"coeffs": [1.0, 0.0], "x_range": [0.1, 0.5]},
                     "0.4": {"coeffs": [2.0], "x_range": [0.1, 0.5]}}}
    data.update(over)
    path.write_text(json.dumps(data))
    return path


def test_calibration_file_tau_and_target_selection(tmp_path):
    cal = Calibration.load(_write_cal(tmp_path / "c.json"))
    tau = cal.tau(None)  # default target 0.6: tau(x) = x, x clamped to [0.1, 0.5]
    got = tau(torch.tensor([50, 300, 900]))
    torch.testing.assert_close(got, torch.tensor([0.1, 0.3, 0.5]))
    assert float(cal.tau(0.4)(torch.tensor([300]))) == 2.0
    with pytest.raises(PolicyError, match="cotserve calibrate sinkrouter"):
        cal.tau(0.5)
    policy = SinkRouterPolicy(SinkRouterConfig(calibration=str(tmp_path / "c.json"), target_skip=0.4))
    batch = make_batch(policy)
    assert float(policy.tau(batch.cache.lens[2])[0]) == 2.0


def test_refuses_without_calibration_and_names_the_command(tmp_path):
    policy = SinkRouterPolicy(SinkRouterConfig())
    with pytest.raises(PolicyError, match=r"cotserve calibrate sinkrouter --model no-such-model"):
        policy.resolve_calibration("no-such-model")
    with pytest.raises(PolicyError, match="does not exist"):
        build_policy("sinkrouter", {"calibration": str(tmp_path / "missing.json")})
    with pytest.raises(PolicyError, match="not valid"):
        Calibration.load(_write_cal(tmp_path / "bad.json", score="nope"))
    wrong = SinkRouterPolicy(SinkRouterConfig(calibration=str(_write_cal(tmp_path / "w.json", num_layers=7))))
    with pytest.raises(PolicyError, match="7 layers"):
        make_batch(wrong)


def test_shipped_calibration_matches_the_bundled_model_and_is_refused_elsewhere():
    """The shipped file passes the policy's own check for the bundled model, and the same check
    refuses it for other layer counts, another model or other first layers. (Whether its tau
    realises the target skip on text it was not fitted on: test_sinkrouter_engine.)"""
    from cotserve.policies.sinkrouter import check_calibration, shipped_calibration

    cal = Calibration.load(shipped_calibration("smollm2-135m-instruct"))
    check_calibration(cal, "smollm2-135m-instruct", 30, 3, cal.first_layers)
    for args, msg in [(("smollm2-135m-instruct", 24, 3, cal.first_layers), "30 layers"),
                      (("qwen2.5-0.5b-instruct", 30, 3, cal.first_layers), "was made for model"),
                      (("smollm2-135m-instruct", 30, 3, cal.first_layers + 1), "first_layers")]:
        with pytest.raises(PolicyError, match=msg):
            check_calibration(cal, *args)


def test_policy_refuses_a_calibration_fitted_with_other_first_layers(tmp_path):
    """The latent bug: a file fitted with first_layers=2 loaded into first_layers=0 would give the
    never-fitted layers 0-1 P(sink)=0.5 (Platt a=b=0), above tau: every group skipped."""
    path = _write_cal(tmp_path / "c.json", first_layers=2)
    make_batch(SinkRouterPolicy(SinkRouterConfig(calibration=str(path), first_layers=2)))
    for fl in (0, 3):
        with pytest.raises(PolicyError, match="first_layers"):
            make_batch(SinkRouterPolicy(SinkRouterConfig(calibration=str(path), first_layers=fl)))
    other = _write_cal(tmp_path / "o.json", model="another-model")
    with pytest.raises(PolicyError, match="was made for model"):
        make_batch(SinkRouterPolicy(SinkRouterConfig(calibration=str(other))))


def test_average_precision_counts_ties_as_one_block_and_a_constant_gets_the_base_rate():
    y = np.array([1, 0, 0, 1, 0, 0, 0, 0])
    assert average_precision(np.zeros(8), y) == pytest.approx(0.25)  # no tie order flatters it
    # a positive tied with negatives gets the precision at the end of its block
    assert average_precision(np.array([2.0, 1.0, 1.0, 0.0]), np.array([0, 1, 0, 1])) == pytest.approx(
        (1 / 3 + 2 / 4) / 2)
    from cotserve.sinkrouter_calibration import group_base_rate

    layer = np.array([0, 0, 1, 1, 1, 1])
    group = np.zeros(6, dtype=int)
    labels = np.array([1, 0, 0, 0, 0, 1])
    rate = group_base_rate(labels, layer, group, 2, 1)
    assert rate[:, 0].tolist() == [0.5, 0.25]


def test_average_precision_and_platt_on_synthetic_data():
    assert average_precision(np.array([3.0, 2.0, 1.0]), np.array([1, 1, 0])) == 1.0
    # positives at ranks 1 and 3: (1/1 + 2/3) / 2
    assert average_precision(np.array([3.0, 2.0, 1.0]), np.array([1, 0, 1])) == pytest.approx(5 / 6)
    rng = np.random.default_rng(0)
    n = 4000
    layer = rng.integers(0, 2, n)
    group = rng.integers(0, 2, n)
    z = rng.normal(size=n) + np.where(layer == 1, 5.0, 0.0)  # layer 1 is shifted: raw z misranks
    y = z - np.where(layer == 1, 5.0, 0.0) > 1.0
    a, b = fit_platt(z, y, layer, group, 2, 2)
    p = 1 / (1 + np.exp(-(a[layer, group] * z + b[layer, group])))
    assert average_precision(p, y) > average_precision(z, y) + 0.2
    assert (a > 0).all()


def test_taufit_is_a_polynomial_in_normalised_length():
    f = TauFit(coeffs=[1.0, -2.0, 0.5, 3.0], norm_length=100, x_lo=0.0, x_hi=10.0)
    x = torch.tensor([10, 50, 200])
    xs = x.double() / 100
    torch.testing.assert_close(f(x), (xs**3 - 2 * xs**2 + 0.5 * xs + 3).float())
