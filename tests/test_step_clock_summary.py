"""tools/device/step_clock_summary.py: a served run's step-clock lines split into stretches between idle
gaps, SFI's decode-only steps told apart from dense requests' ones; the lines come from a real StepClock."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cotserve.vllm.step_clock import StepClock

_PATH = Path(__file__).resolve().parents[1] / "tools" / "device" / "step_clock_summary.py"
_spec = importlib.util.spec_from_file_location("step_clock_summary", _PATH)
scs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scs)


def _lines() -> list[str]:
    now, lines = [0.0], []
    clock = StepClock(clock=lambda: now[0], on_idle=lambda c: lines.append(json.dumps({"step_clock": c})))

    def step(max_q: int, refreshes: int, slow: int, sfi: int, dt: float) -> None:
        clock.mark(SimpleNamespace(max_query_len=max_q))
        clock.note(refreshes, slow, sfi)
        now[0] += dt

    step(1, 0, 0, 0, 0.004)  # a warm-up: too few steps to be a run
    step(1, 0, 0, 0, 10.0)
    step(512, 0, 0, 0, 0.2)  # a dense run: one prompt chunk, 60 decode steps of 12 ms
    for i in range(60):
        step(1, 0, 0, 0, 0.012)
        if i == 40:  # a request's line, with the counters so far: the run's later steps are still its own
            lines.append(json.dumps({"sfi_steps": 0, "step_clock": clock.counters()}))
    step(1, 0, 0, 0, 10.0)
    step(512, 0, 0, 4, 0.25)  # an SFI run: a prompt chunk, 10 refresh, 20 slow, 40 fast and 5 dense steps
    for kind, n, dt in (((1, 0, 4), 10, 0.008), ((0, 1, 4), 20, 0.007), ((0, 0, 4), 40, 0.005), ((0, 0, 0), 5, 0.006)):
        for _ in range(n):
            step(1, *kind, dt)
    step(1, 0, 0, 0, 10.0)
    step(1, 0, 0, 0, 0.0)
    lines.append(json.dumps({"sfi_steps": 3}))  # a request's line without the clock: skipped
    return lines


def test_stretches_split_sfi_steps_from_dense_ones():
    rows = scs.stretches(_lines())
    assert len(rows) == 2
    dense, sfi = rows
    assert dense["prompt_steps"] == 1 and dense["prompt_ms"] == pytest.approx(200.0)
    assert dense["dense"] == [60, pytest.approx(12.0)]  # the step that opens an idle gap is idle time
    assert dense["refresh"] == [0, 0.0] and dense["sfi"] == [0, 0.0]
    assert sfi["prompt_steps"] == 1 and sfi["prompt_ms"] == pytest.approx(250.0)
    assert sfi["refresh"] == [10, pytest.approx(8.0)] and sfi["slow"] == [20, pytest.approx(7.0)]
    assert sfi["sfi"] == [40, pytest.approx(5.0)]
    assert sfi["dense"] == [5, pytest.approx(6.0)]  # steps without an SFI row: a dense request's
    assert sfi["decode_s"] == pytest.approx(0.08 + 0.14 + 0.2 + 0.03)
    assert sfi["prompt_s"] == pytest.approx(0.25)
    assert sfi["prompt_share"] == pytest.approx(0.25 / (0.25 + 0.45), abs=1e-3)


def test_short_stretches_are_left_out_and_the_cli_prints_json(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(_lines()) + "\n")
    assert scs.main([str(path), "--min-steps", "70"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 1 and out[0]["sfi"][0] == 40
    assert scs.main([]) == 2
