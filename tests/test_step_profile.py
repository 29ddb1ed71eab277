"""The on-demand profiler of the served engine's steps (cotserve/vllm/step_profile.py): nothing until
the trigger file appears, then that many steps recorded by torch.profiler and written as a trace and
a table; a bad trigger or an unwritable directory never stops the steps."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import torch

from cotserve.vllm import process, step_plan
from cotserve.vllm.batch_rows import RowRequest
from cotserve.vllm.step_profile import DEFAULT_STEPS, StepProfiler


def _work() -> None:
    x = torch.randn(64, 64)
    for _ in range(3):
        x = torch.tanh(x @ x)


def test_nothing_is_recorded_until_the_trigger_then_that_many_steps(tmp_path):
    prof = StepProfiler(str(tmp_path), torch.device("cpu"), check_every=4)
    for _ in range(10):
        prof.tick()
        _work()
    assert list(tmp_path.iterdir()) == []  # no trigger: no profile
    (tmp_path / "trigger").write_text("5\n")
    ticks_to_check = 4 - prof.ticks % 4
    for _ in range(ticks_to_check + 6):
        prof.tick()
        _work()
    assert not (tmp_path / "trigger").exists()  # taken at once: one trigger, one profile
    txt = list(tmp_path.glob("steps-*.txt"))
    trace = list(tmp_path.glob("steps-*.json.gz"))
    assert len(txt) == 1 and len(trace) == 1
    head = json.loads(txt[0].read_text().splitlines()[0])
    assert head["steps"] == 5 and head["wall_s"] > 0
    assert "aten::mm" in txt[0].read_text()  # the recorded steps' operators are in the table
    events = json.loads(gzip.decompress(trace[0].read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::tanh" for e in events)


def test_a_trigger_without_a_number_profiles_the_default_and_a_bad_directory_is_survived(tmp_path, caplog):
    prof = StepProfiler(str(tmp_path), torch.device("cpu"), check_every=1)
    (tmp_path / "trigger").write_text("many")
    prof.tick()
    assert prof.steps == DEFAULT_STEPS and "not a number of steps" in caplog.text
    prof.prof.stop()  # end it here: the default window is long
    prof.prof = None
    gone_dir = tmp_path / "vanishing"
    gone_dir.mkdir()
    busy = StepProfiler(str(gone_dir), torch.device("cpu"), check_every=1)
    (gone_dir / "trigger").write_text("2")
    busy.tick()  # the trigger is taken and the window opens
    gone_dir.rmdir()  # the directory goes away under it: its files cannot be written
    for _ in range(3):
        busy.tick()  # logged, and the steps go on
    assert busy.failed and "step profile: failed" in caplog.text
    gone = StepProfiler(str(tmp_path / "missing" / "dir"), torch.device("cpu"), check_every=1)
    for _ in range(3):
        gone.tick()  # no trigger can exist there: nothing happens
    assert not gone.failed
    (tmp_path / "file").write_text("")
    blocked = StepProfiler(str(tmp_path / "file"), torch.device("cpu"), check_every=1)
    blocked.tick()  # a path under a file: neither found nor fatal
    assert blocked.prof is None


def test_the_step_plan_ticks_the_profiler_only_while_its_directory_is_set(tmp_path, monkeypatch):
    proc = process.reset()
    stage = SimpleNamespace(before_compaction=lambda cm, bs: None, plan=lambda cm, bs, ev: cm,
                            step_kinds=lambda: (0, 0, 0))
    cm = SimpleNamespace(seq_lens=torch.zeros(1, dtype=torch.int32), max_query_len=1)
    monkeypatch.setattr(step_plan.runtime_builders, "steer_for", lambda cfg: None)
    monkeypatch.delenv("COTSERVE_VLLM_PROFILE_DIR", raising=False)
    step_plan.plan_step(None, cm, 16, stage, None, None)
    assert proc.step_profile is None
    monkeypatch.setenv("COTSERVE_VLLM_PROFILE_DIR", str(tmp_path))
    (tmp_path / "trigger").write_text("2")
    for _ in range(3):  # steps without requests (vLLM's start-up and capture runs) are never profiled
        step_plan.plan_step(None, cm, 16, stage, None, None)
    assert proc.step_profile is not None and proc.step_profile.ticks == 0 and proc.step_profile.prof is None
    proc.rows.add(0, RowRequest(prompt_ids=[1, 2], output_ids=[]))
    for _ in range(4):  # the first serving step takes the trigger; two steps later the profile is written
        step_plan.plan_step(None, cm, 16, stage, None, None)
    (txt,) = tmp_path.glob("steps-*.txt")
    assert not (tmp_path / "trigger").exists()
    # while it records, the plan's parts are named ranges of the trace and the table
    assert "cotserve: sfi plan" in txt.read_text() and "cotserve: sfi refreshes" in txt.read_text()
    (trace,) = tmp_path.glob("steps-*.json.gz")
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert {"cotserve: sfi plan", "cotserve: sfi refreshes"} <= names
    process.reset()
