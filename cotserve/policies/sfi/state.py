"""One SFI request's state in the runtimes that keep it per request: `SFIRequestState`.

The CPU backend's runtime on vLLM (`cotserve.vllm.sfi_runtime.SeqState`: its own ring and compact
buffers) and the paged form on persistent buffers (`paged.SlotState`: a slot of them, used by
vLLM's CUDA backend and the native engine's CUDA graphs) extend it. Here is what they share: the
options and the refresh trigger, the counters SFI's telemetry reports, the positions the query
ring holds, and the terms of a pending refresh of a request whose cache an eviction compacted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cotserve.policies.sfi.config import SFIConfig
from cotserve.policies.sfi.trigger import RefreshTrigger

S = TypeVar("S", bound="SFIRequestState")


def ring_size(cfg: SFIConfig) -> int:
    """Query rows a request keeps per layer: the bootstrap's `prefill_window` prompt rows and the
    slow steps' `obs_window` decode rows (position p at index p % size)."""
    return max(cfg.prefill_window, cfg.obs_window)


@dataclass
class SFIRequestState:
    """What every SFI runtime keeps of one request (module docstring)."""

    cfg: SFIConfig
    trigger: RefreshTrigger
    prompt_len: int
    kv_len: int = 0  # the request's length after the last planned step (its true length)
    steps: int = 0  # decode steps
    slow_steps: int = 0
    retained_sum: float = 0.0  # per decode step, the share of the context read (a slow step: 1.0)
    k_eff: int = 0  # entries per head the last refresh selected
    ring_pos: list[int] = field(default_factory=list)  # position held at each ring index, -1 none
    # an evicting request's pending refresh: the true positions [L, Hkv, n] of its (physical)
    # entries (None: their indices) and its block row, as the step that computed the evidence saw them
    refresh_pos: torch.Tensor | None = None
    refresh_blocks: torch.Tensor | None = None

    @classmethod
    def start(cls: type[S], cfg: SFIConfig, prompt_len: int, **fields: Any) -> S:
        """A request's state at admission: the trigger of its options, a ring of `ring_size(cfg)`
        positions holding none; `fields`: the subclass's own."""
        trigger = RefreshTrigger(cfg.trigger, cfg.min_gap, cfg.max_interval, cfg.cooldown, cfg.period)
        return cls(cfg=cfg, trigger=trigger, prompt_len=prompt_len, ring_pos=[-1] * ring_size(cfg), **fields)

    def telemetry(self) -> dict[str, float | int]:
        """The request's SFI telemetry (the native policy's keys) from its counters."""
        n = self.steps
        return {"sfi_steps": n, "sfi_slow_steps": self.slow_steps,
                "sfi_slow_step_ratio": round(self.slow_steps / n, 4) if n else 0.0,
                "sfi_retained_ratio": round(self.retained_sum / n, 4) if n else 1.0,
                "sfi_selected_per_head": self.k_eff}


def sfi_telemetry(st: SFIRequestState) -> dict[str, float | int]:
    """`st`'s telemetry (the runtimes' `telemetry(state)`)."""
    return st.telemetry()
