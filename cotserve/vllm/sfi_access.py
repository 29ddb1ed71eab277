"""The CPU backend's SFI runtime bound to vLLM's attention layers (`SFIAccess`).

`runtime_builders.runtime_for` makes it at the first step with an SFI request and keeps it in
`process.runtimes().sfi_access`; the CPU backend's metadata builder plans each step through it,
and its layers call `SFIRuntime.attend` with the paged cache reader made here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from cotserve.vllm import compat
from cotserve.vllm.batch_rows import BatchRows
from cotserve.vllm.sfi_runtime import SFIRuntime, StepPlan

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class SFIAccess:
    runtime: SFIRuntime
    layers: list  # vLLM Attention modules in layer order
    rows: BatchRows  # the process's batch rows (`process.runtimes().rows`)
    paged: object = None

    def kv_caches(self) -> list[torch.Tensor]:
        return compat.layer_caches(self.layers)

    @staticmethod
    def layer_index(layer) -> int:
        m = _LAYER.search(layer.layer_name)
        return int(m.group(1)) if m else 0

    def select_pending(self) -> None:
        """Pending selections of requests that also evict, before the eviction runtime's `plan`
        (`SFIRuntime.select_pending`)."""
        if self.paged is not None:
            self.runtime.select_pending(self.rows, self.paged, self.kv_caches())

    def plan_step(self, cm, block_size: int, evict=None) -> StepPlan | None:
        """The step's SFI plan; `evict`: the eviction runtime whose `plan` rewrote `cm` to physical terms."""
        rows = self.rows
        if not any(r.sfi is not None for r in rows.rows.values()) and not rows.released:
            self.runtime.plan_now = None
            return None
        if self.paged is None:
            self.paged = make_paged(self.layers[0], block_size, self.runtime.dtype)
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        lens, positions = None, None
        if evict is not None and any(r.sfi is not None and r.evict is not None for r in rows.rows.values()):
            lens = compat.host_lens(cm)[: cm.num_reqs].tolist()

            def positions(req, n: int) -> torch.Tensor | None:
                est = req.evict_state
                return evict.positions(est, n) if est is not None and est.pos is not None else None

        return self.runtime.plan(rows, cm.num_reqs, qsl, self.paged, self.kv_caches(), cm.block_table_tensor,
                                 lens, positions)


def make_paged(layer, block_size: int, dtype: torch.dtype):
    """The CPU cache reader (this runtime serves the CPU backend; CUDA has `graph_sfi`)."""
    from cotserve.vllm.cpu_paged import CPUPagedKV, key_layout

    return CPUPagedKV(block_size, key_layout(compat.cpu_isa(layer), dtype, layer.impl.head_size, block_size))
