"""The policy base classes the native engine calls: `Policy` (every hook with a dense or no-op
default, so a policy overrides only what it answers), `PolicyStack` (at most one policy per axis,
hooks in the order read, evict, steer) and the dense attention defaults.

A policy owns per-sequence state and answers one question per decode step: which positions to
READ (sfi, sinkrouter, quest), which to DROP (skipkv, h2o, ...), or how to STEER the hidden state.
The engine does the mechanics (cache layout, kernels) and asks through the hooks, whose contract
(torch-free, with the order the engine calls them in) is `cotserve/policies/interface.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from cotserve.policies.interface import Axis, PolicyConfig, Runtime

__all__ = ["Axis", "Policy", "PolicyConfig", "PolicyStack", "causal_prefill", "dense_decode", "grouped_attention"]

if TYPE_CHECKING:
    from cotserve.kv.batch import BatchState
    from cotserve.policies.interface import PooledForm, PoolView


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Plain torch reference attention for GQA without repeating K/V.

    q [B, Hq, T, D], k/v [B, Hkv, S, D], valid: bool mask broadcastable to [B, 1, T, S] or None.
    Returns [B, Hq, T, D]."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.view(b, hkv, g * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*T, S]
    if valid is not None:
        scores = scores.view(b, hkv, g, t, -1)
        scores = scores.masked_fill(~valid.view(b, 1, 1, *valid.shape[-2:]), float("-inf"))
        scores = scores.view(b, hkv, g * t, -1)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hkv, G*T, D]
    return out.view(b, hq, t, d)


def dense_decode(q: torch.Tensor, batch: BatchState, layer: int) -> torch.Tensor:
    """Dense single-token attention over every valid cache entry: the baseline decode step.

    On CUDA it runs the Triton two-source decode kernel (kernels/decode_attention.py) with an
    empty first source; elsewhere the plain torch GQA attention."""
    if q.device.type == "cuda":
        from cotserve.kernels.decode_attention import HAVE_TRITON, decode_attention_triton

        if HAVE_TRITON:
            cache = batch.cache
            k, v = cache.k[layer], cache.v[layer]
            lens = cache.lens[layer].unsqueeze(1).expand(-1, k.shape[1])
            zeros = torch.zeros_like(lens)
            out = decode_attention_triton(q[:, :, 0], k, v, zeros, k, v, zeros, lens, zeros, batch.scaling)
            return out.unsqueeze(2)
    k, v, valid = batch.cache.view(layer)
    return grouped_attention(q, k, v, valid.unsqueeze(1), batch.scaling)


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal prompt attention on a right-padded block: pads sit after every real token, so a
    causal mask alone is exact for the real rows."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)


class Policy:
    """Base class. Subclasses set `name`, `axis` and `config_cls`, and override hooks."""

    name: ClassVar[str] = "base"
    axis: ClassVar[str] = Axis.READ
    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig
    # where it runs (`interface.Runtime`): natively by default; a policy the vLLM engine runs says so
    runtimes: ClassVar[frozenset[str]] = Runtime.NATIVE
    # True when every decode-time hook is static-shaped and free of host syncs, so the engine may
    # capture the decode step in a CUDA graph. Policies with slow steps / compaction leave it False.
    graph_safe: ClassVar[bool] = False
    # True when the policy keeps no per-slot state from the prefill, so slots with the same prompt
    # may share one prefill (the engine computes it once and copies the cache rows)
    prefill_shareable: ClassVar[bool] = False
    # True when the policy's prefill hooks are the defaults (causal attention, nothing kept from
    # the prompt's attention, nothing done after a prefill forward), so the continuous engine may
    # prefill a long prompt in chunks interleaved with other sequences' decode steps
    chunked_prefill: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config if config is not None else self.config_cls()

    # capacity planning
    def capacity(self, prompt_lens: list[int], max_new: int) -> int | None:
        """Cache entries needed per slot; None means no opinion (full length)."""
        return None

    def begin(self, batch: BatchState) -> None:
        pass

    def steer(self, layer: int, hidden: torch.Tensor, batch: BatchState) -> torch.Tensor:
        return hidden

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> torch.Tensor | None:
        """Return the attention output, or None to leave it to the next policy / the default."""
        return None

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor | None:
        return None

    def after_forward(self, batch: BatchState) -> None:
        pass

    def telemetry(self, slot: int) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts about how this policy ran (e.g. which implementation), for benchmark reports."""
        return {}

    def graph_ready(self) -> bool:
        """Whether, after `begin`, this policy's decode hooks may run inside a captured CUDA graph
        (fixed launches, no host syncs; `before_step` does the per-step host work). Default: the
        class's `graph_safe`."""
        return self.graph_safe

    def before_step(self, batch: BatchState) -> None:
        """Once per decode step, before the forward (outside any CUDA graph)."""

    def kernel_dense(self) -> bool:
        """True when, after `begin`, this policy's decode step is exact dense attention through the
        C++ CPU kernel and its decode-time hooks keep no state: the continuous engine may then run
        this sequence's attention together with other such sequences in one `ragged_decode` call."""
        return False

    def pooled_form(self, pool: PoolView) -> PooledForm | None:
        """This policy's runtime in the continuous engine's pooled decode step, over every slot of
        `pool`, or None: its sequences decode through the eager path (the default). Asked when a
        sequence of this policy alone asks for a slot while the pool holds no runtime of its name;
        None for these options lets a later sequence ask again (`interface.PooledForm`)."""
        return None


@dataclass
class PolicyStack:
    """At most one policy per axis; hooks go to each part in the order read, evict, steer."""

    parts: list[Policy] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.parts) or "dense"

    def graph_safe(self) -> bool:
        """Whether the engine may capture the decode step (every part `graph_ready`, after `begin`)."""
        return all(p.graph_ready() for p in self.parts)

    def before_step(self, batch: BatchState) -> None:
        for p in self.parts:
            p.before_step(batch)

    def prefill_shareable(self) -> bool:
        return all(p.prefill_shareable for p in self.parts)

    def chunked_prefill(self) -> bool:
        return all(p.chunked_prefill for p in self.parts)

    def kernel_dense(self) -> bool:
        """Every part's decode step is the C++ kernel's dense attention (`Policy.kernel_dense`)."""
        return bool(self.parts) and all(p.kernel_dense() for p in self.parts)

    def steers(self) -> bool:
        """Whether any part overrides `steer` (the continuous engine skips the hook otherwise)."""
        return any(type(p).steer is not Policy.steer for p in self.parts)

    def capacity(self, prompt_lens: list[int], max_new: int) -> int:
        full = max(prompt_lens) + max_new + 1
        asked = [c for p in self.parts if (c := p.capacity(prompt_lens, max_new)) is not None]
        return min([full, *asked]) if asked else full

    def begin(self, batch: BatchState) -> None:
        for p in self.parts:
            p.begin(batch)

    def steer(self, layer: int, hidden: torch.Tensor, batch: BatchState) -> torch.Tensor:
        for p in self.parts:
            hidden = p.steer(layer, hidden, batch)
        return hidden

    def prefill_attention(self, layer: int, q, k, v, batch: BatchState) -> torch.Tensor:
        for p in self.parts:
            out = p.prefill_attention(layer, q, k, v, batch)
            if out is not None:
                return out
        return causal_prefill(q, k, v, batch.scaling)

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor:
        for p in self.parts:
            out = p.decode_attention(layer, q, batch)
            if out is not None:
                return out
        return dense_decode(q, batch, layer)

    def after_forward(self, batch: BatchState) -> None:
        for p in self.parts:
            p.after_forward(batch)

    def telemetry(self, slot: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.parts:
            out.update(p.telemetry(slot))
        return out
