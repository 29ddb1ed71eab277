"""The worker process's runtimes, in one object: `runtimes()` returns it.

vLLM builds its attention backends, logits processors and model classes itself, so none of them
can be handed cotserve's state; they find it here instead. One `ProcessRuntimes` per vLLM worker
process holds:

* `rows`: which request sits in which batch row, with its policy (`batch_rows.BatchRows`), fed by
  the row tracker (`logitsproc.RowTracker`) and read by the attention backends;
* `hidden`: the last forward's final hidden states (`hidden.HiddenBuffer`), for SkipKV;
* `sfi_access`: the CPU backend's SFI runtime and its layers (`sfi_access.SFIAccess`), made at
  the first step with an SFI request;
* `graph_sfi`: the CUDA backend's SFI runtime (`graph_sfi.GraphSFI`), made while the model loads;
* `evict`: the eviction runtime (`evict_runtime.EvictRuntime`);
* `steer` and `steer_buffers`: the steering runtime (`steer_runtime.SteerRuntime`) and the
  steering hook's persistent inputs (`steer_runtime.SteerBuffers`, made with the hook);
* `scratch` and `reserved`: the working tensors' GPU reservation made at model load and what was
  reserved there, by purpose (`gpu_memory`);
* `step_clock`: the engine steps' time by kind (`step_clock.StepClock`), kept only while the
  telemetry is on; `step_profile`: the on-demand profiler of the engine's steps
  (`step_profile.StepProfiler`), made while $COTSERVE_VLLM_PROFILE_DIR is set.

Builders fill the runtime fields on first need (`runtime_builders`, `cuda_backend`); until then they
are None. `reset()` empties the object in place (the same instance), for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from cotserve.vllm.batch_rows import BatchRows
from cotserve.vllm.hidden import HiddenBuffer

if TYPE_CHECKING:
    from cotserve.vllm.evict_runtime import EvictRuntime
    from cotserve.vllm.graph_sfi import GraphSFI
    from cotserve.vllm.sfi_access import SFIAccess
    from cotserve.vllm.steer_runtime import SteerBuffers, SteerRuntime
    from cotserve.vllm.step_clock import StepClock
    from cotserve.vllm.step_profile import StepProfiler


@dataclass
class ProcessRuntimes:
    """What one vLLM worker process holds of cotserve's (see the module docstring)."""

    rows: BatchRows = field(default_factory=BatchRows)
    hidden: HiddenBuffer = field(default_factory=HiddenBuffer)
    sfi_access: SFIAccess | None = None  # CPU backend
    graph_sfi: GraphSFI | None = None  # CUDA backend
    evict: EvictRuntime | None = None
    steer: SteerRuntime | None = None
    steer_buffers: SteerBuffers | None = None
    scratch: torch.Tensor | None = None
    reserved: dict[str, int] = field(default_factory=dict)  # bytes reserved at model load, by purpose
    step_clock: StepClock | None = None
    step_profile: StepProfiler | None = None  # while $COTSERVE_VLLM_PROFILE_DIR is set


_RUNTIMES = ProcessRuntimes()


def runtimes() -> ProcessRuntimes:
    """This process's one `ProcessRuntimes`."""
    return _RUNTIMES


def reset() -> ProcessRuntimes:
    """Empty this process's runtimes in place (the instance stays the one `runtimes()` returns)."""
    fresh = ProcessRuntimes()
    for f in fields(ProcessRuntimes):
        setattr(_RUNTIMES, f.name, getattr(fresh, f.name))
    return _RUNTIMES
