"""The per-step pipeline both attention backends run in their metadata builder, in one order.

Before vLLM builds a step's attention metadata, the plugin plans the step for the requests that
run a cotserve policy (and, while the telemetry is on, marks the step's start for `step_clock`):

1. steering: which of the step's rows get the steering vector (`steer_runtime`);
2. SFI's work that must see the cache as the last step left it: the refreshes (selections) due
   from that step, before a compaction moves entries;
3. eviction: the compactions due now, and the metadata rewritten in physical terms
   (`evict_runtime.EvictRuntime.plan`);
4. SFI's plan on that metadata: which rows read their compact buffers, and the lengths vLLM's
   own kernel reads for them.

Each backend brings its SFI runtime through `SFIStage` (the CPU one is made at the first SFI
request, the CUDA one while the model loads) and its cache reader for the compactions.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol

import torch

from cotserve.vllm import compat, runtime_builders
from cotserve.vllm.process import runtimes
from cotserve.vllm.step_clock import StepClock
from cotserve.vllm.step_profile import StepProfiler, profile_dir
from cotserve.vllm.telemetry import telemetry_on, write_telemetry


class SFIStage(Protocol):
    def before_compaction(self, cm: Any, block_size: int) -> None:
        """Step 2: what must read the cache before this step's compactions."""

    def plan(self, cm: Any, block_size: int, evict: Any) -> Any:
        """Step 4: the step's SFI plan on `cm` (after `evict`'s plan, or None); returns the
        metadata vLLM's builder gets."""

    def step_kinds(self) -> tuple[int, int, int]:
        """For the step clock: (refreshes run before this step, slow rows in it, SFI rows in it)."""


def plan_step(vllm_config: Any, cm: Any, block_size: int, sfi: SFIStage, evict: Any, evict_paged: Any) -> Any:
    """Steps 1-4 for one step's common attention metadata `cm`; returns the metadata to build."""
    proc = runtimes()
    if proc.step_profile is not None or profile_dir():
        _profile_tick(proc, cm)
    if telemetry_on():
        if proc.step_clock is None:
            proc.step_clock = StepClock(device=cm.seq_lens.device,
                                        on_idle=lambda counters: write_telemetry({"step_clock": counters}))
        proc.step_clock.mark(cm)
        for runtime in (proc.graph_sfi, proc.sfi_access.runtime if proc.sfi_access is not None else None):
            if runtime is not None:  # its telemetry lines carry the clock's counters
                runtime.step_clock = proc.step_clock
    label = _label if proc.step_profile is not None and proc.step_profile.prof is not None else _no_label
    steer = runtime_builders.steer_for(vllm_config)
    if steer is not None:
        with label("cotserve: steering plan"):
            steer.plan(proc.rows, cm, proc.steer_buffers)
    with label("cotserve: sfi refreshes"):
        sfi.before_compaction(cm, block_size)
    if evict is not None:
        with label("cotserve: eviction plan"):
            cm = evict.plan(proc.rows, cm, block_size, compat.layer_caches(evict.layers), evict_paged,
                            proc.hidden.buf)
    with label("cotserve: sfi plan"):
        cm = sfi.plan(cm, block_size, evict)
    if proc.step_clock is not None and telemetry_on():
        proc.step_clock.note(*sfi.step_kinds())
    return cm


def _label(name: str) -> Any:
    """A named range in the step profile's trace and tables (host time, and the kernels launched in it)."""
    return torch.profiler.record_function(name)


def _no_label(name: str) -> Any:
    return nullcontext()


def _profile_tick(proc: Any, cm: Any) -> None:
    """The step profiler's tick (made at the first step with $COTSERVE_VLLM_PROFILE_DIR set); a graph
    capture is not a step."""
    device = cm.seq_lens.device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    if proc.step_profile is None:
        proc.step_profile = StepProfiler(profile_dir(), device)
    proc.step_profile.tick(serving=bool(proc.rows.rows))
