"""Where a served run's time goes, by kind of engine step: steps that carry prompt tokens (a prefill
chunk, with or without decoding rows beside it) and decode-only steps; of the decode-only steps,
those that ran SFI refreshes before their forward (`decode_refresh_*`), of the rest those with an
SFI slow row (`decode_slow_*`), and of the rest those with any SFI row (`decode_sfi_*`: fast rows,
or rows too short to skip anything), as the step's plan tells them (`note`; the CUDA backend's). So
a stretch that ran dense and SFI requests apart splits into SFI's decode-only steps (those three)
and the others.

Kept only while $COTSERVE_VLLM_TELEMETRY is set. On CUDA each step's plan records an event on the
step's stream, so the time between two consecutive events is the GPU time of the first one's step
(waits for the host included); completed events are read without waiting (`Event.query`). On a CPU,
where vLLM schedules synchronously, a step's time is the host time from its plan to the next
step's. A gap longer than `idle_s` is the engine waiting for requests: it counts as idle, not as a
step's time (the step just before it goes with it), and a telemetry line with the counters so far is
written then (a load generator's runs are separated by such gaps, so consecutive lines bracket a run).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

IDLE_S = 2.0  # a gap this long between two steps is idle time, not a step's


@dataclass
class StepClock:
    """Counts and times engine steps by kind; `mark(cm)` once per step, before its forward."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    idle_s: float = IDLE_S
    clock: Callable[[], float] = time.perf_counter  # the CPU timer (tests pass their own)
    on_idle: Callable[[dict], None] | None = None  # called with `counters()` when an idle gap ends
    prompt_steps: int = 0
    decode_steps: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    idle_gaps: int = 0
    refresh_steps: int = 0  # decode-only steps that ran refreshes (a subset of decode_steps)
    refresh_s: float = 0.0
    slow_steps: int = 0  # decode-only steps with a slow row and no refresh (a subset of decode_steps)
    slow_s: float = 0.0
    sfi_steps: int = 0  # decode-only steps with SFI rows but no refresh and no slow row (a subset of decode_steps)
    sfi_s: float = 0.0
    _open: deque = field(default_factory=deque)  # [mark, carries prompt tokens, kind] not yet timed
    _marked: bool = False  # the last `mark` opened a step (not a capture's call)

    def mark(self, cm: Any) -> None:
        """Step `cm` (vLLM's common attention metadata) starts: close the previous step's interval."""
        self._marked = False
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():  # a graph capture, not a step
                return
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open.append([ev, int(cm.max_query_len) > 1, ""])
            self._marked = True
            while len(self._open) >= 2 and self._open[1][0].query():
                start, prompt, kind = self._open.popleft()
                self._add(start.elapsed_time(self._open[0][0]) / 1000.0, prompt, kind)
        else:
            now = self.clock()
            self._open.append([now, int(cm.max_query_len) > 1, ""])
            self._marked = True
            if len(self._open) >= 2:
                start, prompt, kind = self._open.popleft()
                self._add(now - start, prompt, kind)

    def note(self, refreshes: int, slow_rows: int, sfi_rows: int = 0) -> None:
        """What the step marked last did beside its forward: refreshes run before it, slow rows and
        SFI rows in it (nothing when that call was a graph capture's, not a step's)."""
        if self._marked and self._open:
            self._open[-1][2] = "refresh" if refreshes else "slow" if slow_rows else "sfi" if sfi_rows else ""

    def _add(self, seconds: float, prompt: bool, kind: str = "") -> None:
        if seconds > self.idle_s:
            self.idle_gaps += 1
            if self.on_idle is not None:
                self.on_idle(self.counters())
            return
        if prompt:
            self.prompt_steps += 1
            self.prompt_s += seconds
        else:
            self.decode_steps += 1
            self.decode_s += seconds
            if kind == "refresh":
                self.refresh_steps += 1
                self.refresh_s += seconds
            elif kind == "slow":
                self.slow_steps += 1
                self.slow_s += seconds
            elif kind == "sfi":
                self.sfi_steps += 1
                self.sfi_s += seconds

    def counters(self) -> dict:
        """The counters so far (cumulative since the process started)."""
        return {"prompt_steps": self.prompt_steps, "prompt_steps_s": round(self.prompt_s, 4),
                "decode_steps": self.decode_steps, "decode_steps_s": round(self.decode_s, 4),
                "idle_gaps": self.idle_gaps, "decode_refresh_steps": self.refresh_steps,
                "decode_refresh_steps_s": round(self.refresh_s, 4), "decode_slow_steps": self.slow_steps,
                "decode_slow_steps_s": round(self.slow_s, 4), "decode_sfi_steps": self.sfi_steps,
                "decode_sfi_steps_s": round(self.sfi_s, 4)}


def step_counters(clock: StepClock | None) -> dict:
    """`{"step_clock": counters}` for a telemetry line ({} before the first step is marked)."""
    return {} if clock is None else {"step_clock": clock.counters()}
