"""The step clock: engine steps' time by kind (prompt-carrying or decode-only), idle gaps apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cotserve.vllm.step_clock import StepClock, step_counters


def _step(max_query_len: int) -> SimpleNamespace:
    return SimpleNamespace(max_query_len=max_query_len)  # the one field of vLLM's metadata it reads


def test_each_interval_goes_to_the_step_that_opened_it():
    now = [0.0]
    clock = StepClock(clock=lambda: now[0])
    # a prompt chunk of 0.2 s, three decode steps of 0.01 s, a prompt chunk beside decodes of 0.15 s
    for max_q, dt in ((512, 0.2), (1, 0.01), (1, 0.01), (1, 0.01), (300, 0.15), (1, 0.0)):
        clock.mark(_step(max_q))
        now[0] += dt
    c = clock.counters()
    assert (c["prompt_steps"], c["decode_steps"], c["idle_gaps"]) == (2, 3, 0)
    assert c["prompt_steps_s"] == pytest.approx(0.35) and c["decode_steps_s"] == pytest.approx(0.03)


def test_an_idle_gap_is_no_steps_time_and_writes_the_counters_so_far():
    now, lines = [0.0], []
    clock = StepClock(clock=lambda: now[0], on_idle=lines.append)
    for max_q, dt in ((64, 0.1), (1, 0.02), (1, 30.0), (64, 0.1), (1, 0.0)):
        clock.mark(_step(max_q))
        now[0] += dt
    # the run's last step sits inside the 30-s gap: counted as idle
    assert lines == [{"prompt_steps": 1, "prompt_steps_s": 0.1, "decode_steps": 1, "decode_steps_s": 0.02,
                      "idle_gaps": 1, "decode_refresh_steps": 0, "decode_refresh_steps_s": 0.0,
                      "decode_slow_steps": 0, "decode_slow_steps_s": 0.0, "decode_sfi_steps": 0,
                      "decode_sfi_steps_s": 0.0}]
    c = clock.counters()
    assert (c["prompt_steps"], c["decode_steps"], c["idle_gaps"]) == (2, 1, 1)
    assert step_counters(clock) == {"step_clock": c} and step_counters(None) == {}


def test_decode_steps_are_told_apart_by_what_their_plan_did():
    now = [0.0]
    clock = StepClock(clock=lambda: now[0])
    # (max query len, refreshes, slow rows, SFI rows, seconds): a refresh step counts as such even with a
    # slow row, a slow step as such among fast rows; a prompt-carrying step is none of them; a step with
    # no SFI row (a dense run's) is only a decode step
    for max_q, refreshes, slow, sfi, dt in ((64, 1, 0, 3, 0.2), (1, 0, 0, 0, 0.005), (1, 0, 2, 4, 0.006),
                                            (1, 1, 0, 4, 0.009), (1, 2, 1, 4, 0.01), (1, 0, 0, 4, 0.004),
                                            (1, 0, 0, 2, 0.003), (1, 0, 0, 0, 0.0)):
        clock.mark(_step(max_q))
        clock.note(refreshes, slow, sfi)
        now[0] += dt
    c = clock.counters()
    assert (c["decode_steps"], c["decode_refresh_steps"], c["decode_slow_steps"], c["decode_sfi_steps"]) == (6, 2, 1, 2)
    assert c["decode_refresh_steps_s"] == pytest.approx(0.019) and c["decode_slow_steps_s"] == pytest.approx(0.006)
    assert c["decode_sfi_steps_s"] == pytest.approx(0.007)
    assert c["decode_steps_s"] == pytest.approx(0.037) and c["prompt_steps_s"] == pytest.approx(0.2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_are_timed_by_events_without_waiting_cuda():
    dev = torch.device("cuda")
    clock = StepClock(device=dev)
    x = torch.randn(4096, 4096, device=dev)
    for max_q in (512, 1, 1, 1):
        clock.mark(_step(max_q))
        for _ in range(20):
            x = (x @ x).clamp_(-1, 1)
    torch.cuda.synchronize()
    clock.mark(_step(1))
    torch.cuda.synchronize()
    clock.mark(_step(1))  # the events before it are complete: every interval up to it is read
    c = clock.counters()
    assert c["prompt_steps"] == 1 and c["decode_steps"] >= 4 and c["idle_gaps"] == 0
    assert c["prompt_steps_s"] > 0 and c["decode_steps_s"] > 0
