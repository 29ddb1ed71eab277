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

    found = data_dir(required=False)
    if found is None:
        pytest.skip("no dataset directory (set COTSERVE_DATA_DIR): calibration needs real text")
    report, records = calibrate(engine, LENGTHS, STEPS, 1, [0.6, 0.4], data_dir=str(found))
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    write_calibration(report, str(path))
    return path, report, records


def test_fitted_tau_on_held_out_text_and_the_held_out_baselines(engine, small_cal, data_dir):
    """The fit's skip ratio on its own records is exact by construction; on text it never saw
    (records after an offset) the realised skip must stay near the target, and more skipping must
    be asked for by the higher target. The report's held-out comparison scores the same text."""
    from cotserve.sinkrouter_calibration import (
        average_precision,
        collect,
        group_base_rate,
    )

    path, report, records = small_cal
    cal = Calibration.load(path)  # the runtime's reading of the file
    held = collect(engine, LENGTHS, STEPS, 1, 0.65, cal.first_layers, str(data_dir), offset=max(LENGTHS) + 16)
    assert held.lengths == LENGTHS and len(held.layer) == len(records.layer)
    raw = torch.from_numpy(held.score(cal.score)).float()
    layer, group = torch.from_numpy(held.layer), torch.from_numpy(held.group)
    s = platt(raw, cal.platt_a[layer, group], cal.platt_b[layer, group])
    ctx = torch.from_numpy(held.ctx)
    realised = {t: float((s >= cal.tau(t)(ctx)).float().mean()) for t in (0.4, 0.6)}
    assert realised[0.6] > realised[0.4]
    for t, r in realised.items():
        assert abs(r - t) <= 0.2, realised
    # the report's held-out numbers are the ones these records give
    ho = report["auprc_heldout_text"]
    y = held.labels(0.65, "all")
    assert ho["records"] == len(y) and ho["sink_rate"] == round(float(y.mean()), 4)
    rate = group_base_rate(records.labels(0.65, "all"), records.layer, records.group, engine.info.num_layers,
                           engine.info.num_kv_heads)
    assert ho["group_base_rate"] == round(average_precision(rate[held.layer, held.group], y), 4)
    assert ho[cal.score] == round(average_precision(held.score(cal.score), y), 4)
    # the true regime really is attention mass on token 0 >= gamma for all the group's heads
    assert np.array_equal(records.labels(0.65, "all"), (records.mass >= 0.65).all(-1))
    assert set(report["per_layer"]) == {str(i) for i in range(cal.first_layers, engine.info.num_layers)}


def test_shipped_calibration_realises_its_targets_on_new_text(engine, data_dir):
    """The shipped file, run by the policy on text far from its calibration text: the skip ratio
    the runtime reports is near each target, higher for the higher one."""
    from cotserve.bench.prompts import long_prompts

    (text,) = long_prompts(engine.tokenizer, 512, 1, str(data_dir), offset=20000)
    got = {}
    for t in (0.4, 0.6):
        (res,) = engine.generate([GenRequest(text, SamplingParams(max_tokens=6, ignore_eos=True))], "sinkrouter",
                                 {"target_skip": t})
        got[t] = res.telemetry["sinkrouter_skip_ratio"]
    assert got[0.6] > got[0.4]
    for t, r in got.items():
        assert abs(r - t) <= 0.25, got


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
    torch.testing.assert_close(fast.logprobs, ref.logprobs, atol=1e-3, rtol=0)  # float32 log-probs
    tele = fast.telemetry
    decode_forwards = STEPS - 1
    assert tele["sinkrouter_eligible_groups"] == decode_forwards * (engine.info.num_layers - 2) * engine.info.num_kv_heads
    assert 0 < tele["sinkrouter_skipped_groups"] < tele["sinkrouter_eligible_groups"]
    # never skipping is dense, token for token
    never = _run(engine, build_policy("sinkrouter", {"tau": "inf"}), prompt)
    dense = _run(engine, "dense", prompt)
    assert never.greedy_ids == dense.greedy_ids and never.telemetry["sinkrouter_skip_ratio"] == 0.0
    torch.testing.assert_close(never.logprobs, dense.logprobs, atol=1e-5, rtol=0)  # the same dense step


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
