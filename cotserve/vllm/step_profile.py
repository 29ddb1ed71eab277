"""A profile of the served engine's steps, on demand, without restarting it.

With $COTSERVE_VLLM_PROFILE_DIR set, the engine looks for the file `DIR/trigger` at its first step
that serves requests and every `CHECK_EVERY` such steps (one `stat`). When it appears, its content (a number of steps, default `DEFAULT_STEPS`, at most
`MAX_STEPS`) says how many of the next steps torch.profiler records, host and (on CUDA) device
activity; the trigger is removed at once. When the window closes the engine writes, under DIR:

* `steps-<time>-<pid>.json.gz`: the Chrome trace (chrome://tracing, Perfetto);
* `steps-<time>-<pid>.txt`: a first line of JSON (`steps`, `wall_s`: the window's host time, `device_s`:
  the summed time of the device kernels the profiler saw, `device_busy`: their ratio, which says
  whether the steps waited for the host), then the operators' table by device time and by host time.

While it records, the plugin's work in each step's plan is a named range of the trace and the tables
(`cotserve: sfi refreshes`, `cotserve: sfi plan`, `cotserve: eviction plan`, `cotserve: steering plan`:
`step_plan.plan_step`), its host time and the kernels it launched told apart from vLLM's own.

The profiler slows the steps it records; what it tells is where their time goes, not how long they
take unprofiled. A failure (a directory that cannot be written, another profiler already on) is
logged once and never stops the engine; with several workers, one takes the trigger.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from cotserve.vllm.settings import variable

log = logging.getLogger(__name__)

_DIR = variable("profile_dir")  # read at every step's plan: one lookup
CHECK_EVERY = 64
DEFAULT_STEPS = 200
MAX_STEPS = 5000


class StepProfiler:
    """`tick(serving)` once per engine step (the step's plan, outside any graph capture); `serving`:
    the step carries requests (vLLM's start-up and graph-capture runs do not, and are never profiled).
    Nothing it does may stop the engine: any failure is logged once and ends the profiler."""

    def __init__(self, directory: str, device: torch.device, check_every: int = CHECK_EVERY):
        self.dir = Path(directory)
        self.device = device
        self.check_every = max(1, check_every)
        self.ticks = 0  # serving steps seen
        self.left = 0  # steps still to record; 0 = not recording
        self.steps = 0
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0
        self.failed = False

    def tick(self, serving: bool = True) -> None:
        if self.failed:
            return
        try:
            self._tick(serving)
        except Exception as exc:  # a profiler already on (vLLM's own), a table that fails: never the engine's end
            self._fail(exc)

    def _tick(self, serving: bool) -> None:
        if self.prof is not None:
            self.left -= 1
            if self.left <= 0:
                self._finish()
            return
        if not serving:
            return
        self.ticks += 1
        if self.ticks % self.check_every and self.ticks != 1:  # the first serving step looks too
            return
        trigger = self.dir / "trigger"
        if trigger.exists():
            self._start(trigger)

    def _start(self, trigger: Path) -> None:
        try:
            text = trigger.read_text().strip()
            trigger.unlink()
        except FileNotFoundError:  # another worker of the engine took it first
            return
        try:
            steps = int(text) if text else DEFAULT_STEPS
        except ValueError:
            log.warning("step profile: the trigger holds %r, not a number of steps; profiling %d", text[:40],
                        DEFAULT_STEPS)
            steps = DEFAULT_STEPS
        self.steps = self.left = max(1, min(MAX_STEPS, steps))
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.start()
        self.t0 = time.perf_counter()
        log.info("step profile: recording the next %d steps", self.steps)

    def _finish(self) -> None:
        prof = self.prof
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside it
        wall = time.perf_counter() - self.t0
        prof.stop()
        self.prof = None
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # one file per worker process
        events = prof.key_averages()
        device_us = sum(e.time_range.elapsed_us() for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA)  # the kernels, once each
        head = {"steps": self.steps, "wall_s": round(wall, 4), "device_s": round(device_us / 1e6, 4),
                "device_busy": round(device_us / 1e6 / wall, 4) if wall > 0 else None}
        parts = [json.dumps(head)]
        if self.device.type == "cuda":
            parts.append(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
        parts.append(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        raw = self.dir / f"steps-{stamp}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        (self.dir / f"steps-{stamp}.txt").write_text("\n\n".join(parts) + "\n")
        log.info("step profile: %d steps in %.3f s written to steps-%s.txt", self.steps, wall, stamp)

    def _fail(self, exc: Exception) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: S110 - already failing: the engine goes on either way
                pass
        if not self.failed:
            log.warning("step profile: failed (%s: %s); the engine goes on unprofiled", type(exc).__name__,
                        str(exc)[:200])
        self.failed = True


def profile_dir() -> str:
    """$COTSERVE_VLLM_PROFILE_DIR, or "" (no profiler)."""
    return os.environ.get(_DIR, "")
