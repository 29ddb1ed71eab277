"""`dense`: full attention over every cached token at every step (the baseline).

The decode step runs, by default, the best dense attention the project has on the device: on a
CPU with a float32 cache, the same C++ kernel family SFI's fast step uses
(`kernels/cpu_decode.cpp`, `two_source_decode` with an empty compact source and the whole cache
as the window: exact attention, float32 throughout); on CUDA the Triton decode kernel
(`policies.base.dense_decode`); elsewhere plain torch. `kernel=torch` forces the plain torch
reference (`policies.base.grouped_attention`), e.g. to show what the kernel buys. Speed ratios of
other policies are quoted against the default, and `bench decode` reports which implementation
each row used (`Policy.describe`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cotserve.kernels import cpu_decode
from cotserve.policies.base import Axis, Policy, PolicyConfig, Runtime, grouped_attention
from cotserve.policies.options import DenseOptions, check_config, options_config
from cotserve.policies.registry import register

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState


@options_config(DenseOptions)
class DenseConfig(PolicyConfig):
    """`DenseOptions`: the decode implementation (`kernel`)."""

    def validate(self) -> None:
        check_config(self)


def kernel_dense_decode(q: torch.Tensor, batch: BatchState, layer: int) -> torch.Tensor:
    """Dense decode attention of q [B, Hq, 1, D] over every valid entry of the layer, through the
    C++ kernel: no compact entries, window = rows 0 .. lens - 1 of the cache. [B, Hq, 1, D]."""
    cache = batch.cache
    b, hq, _, d = q.shape
    k, v = cache.k[layer], cache.v[layer]
    hkv = k.shape[1]
    ck = q.new_empty(b, hkv, 0, d, 16)
    cv = q.new_empty(b, hkv, 0, d)
    cmask = torch.empty(b, hkv, 0, dtype=torch.bool, device=q.device)
    lens = cache.lens[layer]
    out = cpu_decode.two_source_decode(q.reshape(b, hkv, hq // hkv, d), ck, cv, cmask, k, v,
                                       torch.zeros_like(lens), lens, batch.scaling)
    return out.view(b, hq, 1, d)


@register
class DensePolicy(Policy):
    """No selection: every cached entry is read at every step."""

    name = "dense"
    axis = Axis.READ
    config_cls = DenseConfig
    runtimes = Runtime.ALL
    config: DenseConfig
    graph_safe = True  # on CUDA the engine's default (Triton) step runs
    prefill_shareable = True  # no per-sequence state from the prefill: n copies can share one
    chunked_prefill = True  # default prefill hooks: a long prompt may be prefilled in chunks

    def begin(self, batch: BatchState) -> None:
        cache = batch.cache
        self.impl = "torch"
        if self.config.kernel == "torch":
            pass
        elif cache.device.type == "cuda":
            self.impl = "default"  # policies.base.dense_decode: Triton where available
        elif cache.k.dtype == torch.float32 and cpu_decode.available():
            self.impl = "cpu_kernel"

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor | None:
        if self.impl == "cpu_kernel":
            return kernel_dense_decode(q, batch, layer)
        if self.impl == "torch":
            k, v, valid = batch.cache.view(layer)
            return grouped_attention(q, k, v, valid.unsqueeze(1), batch.scaling)
        return None

    def kernel_dense(self) -> bool:
        return getattr(self, "impl", None) == "cpu_kernel"

    def describe(self) -> dict[str, Any]:
        impl = getattr(self, "impl", "unknown")
        if impl == "default":
            from cotserve.kernels.decode_attention import HAVE_TRITON

            impl = "triton" if HAVE_TRITON else "torch"
        return {"dense_step": impl}
