"""SinkRouter on the bundled model: a small real calibration run (the fitted tau(L) realises the
target skip ratio on its data), the engine's fast path against the plain reference, telemetry, the
CLI refusal, and composition with an eviction policy."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.base import Axis, Policy, PolicyStack
from cotserve.policies.registry import REGISTRY, build_policy
from cotserve.policies.sinkrouter import (
    Calibration,
    SinkRouterConfig,
    SinkRouterPolicy,
    platt,
    sinkrouter_decode_reference,
)
from cotserve.sinkrouter_calibration import calibrate, write_calibration

LENGTHS = [96, 192]
STEPS = 6


@pytest.fixture(scope="module")
def small_cal(engine, tmp_path_factory):
    from cotserve.data import data_dir

    found = data_dir(required=False)  # MATH text when present, else long_prompts' fixed random tokens
    report, records = calibrate(engine, LENGTHS, STEPS, 1, [0.6, 0.4], data_dir=str(found) if found else None)
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    write_calibration(report, str(path))
    return path, report, records


def test_fitted_tau_realises_target_skip_on_calibration_data(small_cal):
    path, report, records = small_cal
    cal = Calibration.load(path)  # the runtime's reading of the file
    raw = torch.from_numpy(records.score(cal.score)).float()
    layer = torch.from_numpy(records.layer)
    group = torch.from_numpy(records.group)
    assert cal.platt_a is not None
    s = platt(raw, cal.platt_a[layer, group], cal.platt_b[layer, group])
    ctx = torch.from_numpy(records.ctx)
    assert int(records.layer.min()) == cal.first_layers == 2
    for target in (0.4, 0.6):
        skip = s >= cal.tau(target)(ctx)
        assert abs(float(skip.float().mean()) - target) <= 0.05
        for i in range(len(LENGTHS)):
            m = torch.from_numpy(records.run == i)
            assert abs(float(skip[m].float().mean()) - target) <= 0.05
    assert set(report["auprc"]) >= {"logit_min", "cos_min", f"{report['score']}+platt"}
    assert 0.0 <= report["sink_rate"] <= 1.0
    # the true regime really is attention mass on token 0 >= gamma for all the group's heads
    labels = records.labels(0.65, "all")
    assert np.array_equal(labels, (records.mass >= 0.65).all(-1))


class _ReferenceSinkRouter(SinkRouterPolicy):
    """The same routing, with the plain torch reference (dense read, then zeros) as attention."""

    name = "test_sinkrouter_reference"

    def decode_attention(self, layer, q, batch):
        if layer < self.cfg.first_layers:
            return None
        skip = self.route(layer, q, batch)
        k, v, valid = batch.cache.view(layer)
        return sinkrouter_decode_reference(q, k, v, valid, skip, batch.scaling)


def _run(engine, stack, prompt, n=STEPS):
    req = GenRequest(prompt, SamplingParams(max_tokens=n, ignore_eos=True), record_logprobs=True)
    (res,) = engine.generate([req], stack)
    return res


def test_engine_fast_path_matches_reference_and_reports_skip_ratio(engine, small_cal):
    path, _, _ = small_cal
    prompt = engine.encode_prompt("Explain why the sum of two even numbers is even, step by step.")
    fast = _run(engine, PolicyStack([SinkRouterPolicy(SinkRouterConfig(calibration=str(path)))]), prompt)
    ref = _run(engine, PolicyStack([_ReferenceSinkRouter(SinkRouterConfig(calibration=str(path)))]), prompt)
    assert fast.greedy_ids == ref.greedy_ids
    torch.testing.assert_close(fast.logprobs.float(), ref.logprobs.float(), atol=2e-2, rtol=0)
    tele = fast.telemetry
    decode_forwards = STEPS - 1
    assert tele["sinkrouter_eligible_groups"] == decode_forwards * (engine.info.num_layers - 2) * engine.info.num_kv_heads
    assert 0 < tele["sinkrouter_skipped_groups"] < tele["sinkrouter_eligible_groups"]
    # never skipping is dense, token for token
    never = _run(engine, build_policy("sinkrouter", {"tau": "inf"}), prompt)
    dense = _run(engine, "dense", prompt)
    assert never.greedy_ids == dense.greedy_ids and never.telemetry["sinkrouter_skip_ratio"] == 0.0


class _DropHeadEviction(Policy):
    """Test-only eviction part (a real policy of the evict axis): after every forward, drops the
    four oldest entries of every (layer, slot) once the slot holds more than 40, token 0 included,
    so the anchor is gone from the cache."""

    name = "test_drop_head"
    axis = Axis.EVICT
    dropped_anchor = False

    def after_forward(self, batch):
        cache = batch.cache
        for layer in range(cache.shape.layers):
            for slot in range(batch.batch_size):
                n = int(cache.lens[layer, slot])
                if n > 40:
                    if bool((cache.pos[layer, slot, :, :4] == 0).any()):
                        type(self).dropped_anchor = True
                    keep = torch.arange(4, n, device=cache.device).expand(cache.shape.kv_heads, -1)
                    cache.compact(layer, slot, keep)


def test_composes_with_an_eviction_policy(engine, small_cal):
    path, _, _ = small_cal
    REGISTRY[_DropHeadEviction.name] = _DropHeadEviction
    try:
        prompt = engine.encode_prompt("List three prime numbers and explain what makes each one prime.")
        stack = build_policy("sinkrouter+test_drop_head", {"calibration": str(path)})
        res = _run(engine, stack, prompt)
        alone = SinkRouterPolicy(SinkRouterConfig(calibration=str(path)))
        _run(engine, PolicyStack([alone]), prompt)
    finally:
        REGISTRY.pop(_DropHeadEviction.name)
    router = next(p for p in stack.parts if p.name == "sinkrouter")
    torch.testing.assert_close(router.anchor_k, alone.anchor_k)  # kept although token 0 was evicted
    assert _DropHeadEviction.dropped_anchor
    assert res.completion_tokens == STEPS and res.telemetry["sinkrouter_eligible_groups"] > 0
    info = engine.info
    per_entry = 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4  # float32 K+V, all layers
    assert res.telemetry["kv_bytes_final"] < (len(prompt) + STEPS - 1) * per_entry  # entries were evicted


def test_cli_refuses_without_calibration_naming_the_command(tmp_path):
    missing = tmp_path / "nope.json"
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "hi", "--policy", "sinkrouter",
                           "--policy-opt", f"calibration={missing}", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "cotserve calibrate sinkrouter" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "calibrate", "sinkrouter", "--out",
                           str(tmp_path / "x.json"), "--target-skip", "1.5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--target-skip" in proc.stderr and "Traceback" not in proc.stderr


def test_tau_inf_is_parsed_as_a_float():
    assert math.isinf(build_policy("sinkrouter", {"tau": "inf"}).parts[0].cfg.tau)
