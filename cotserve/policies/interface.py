"""The policy interface between the engine and the policies, without torch.

What the engine may rely on about a policy, and nothing that computes: the axes a policy acts on,
the base class of every policy's options, and the hooks as a `Protocol` (tensor arguments are
typed by name only). `policies/base.py` implements it (`Policy`, `PolicyStack`, the dense
defaults); the engine and the policies both import this module, and so may a process that has no
torch (the gateway validates policy specs and options through `policies/options.py`).

Hooks, in the order the engine calls them for one batch:

  capacity(prompt_lens, max_new)      -> cache entries to preallocate per slot
  begin(batch)                        once, after the cache is allocated
  before_step(batch)                  once per decode step, before the forward (outside CUDA graphs)
  steer(layer, hidden, batch)         hidden state entering each layer (steering axis)
  prefill_attention(layer, q, k, v, batch)   prompt attention (k, v already in the cache)
  decode_attention(layer, q, batch)   one decode step's attention over the cache (read axis)
  after_forward(batch)                after every forward (prefill and decode); eviction runs here
  telemetry(slot)                     per-sequence numbers reported with the response

One more hook is asked by the continuous engine's pooled decode step (`engine/pooled_decode.py`) at
admission, while its pool holds no runtime of that policy's name, never per step:

  pooled_form(pool)                   -> the policy's runtime over every slot of the pool, or None

A policy that answers it (SFI: `policies/sfi/pooled.py`) decodes its sequences in the pooled step:
the pool keeps the runtime under the policy's name, made at the first sequence that joins, and the
step calls it through `PooledForm` alone, so the engine never names a policy. The default (None)
leaves the policy's sequences to the engine's eager path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from cotserve.kv.batch import BatchState


class Axis:
    """What a policy decides: which entries to READ, which to EVICT, or how to STEER."""

    READ = "read"
    EVICT = "evict"
    STEER = "steer"


class Runtime:
    """Where a policy runs: the native engine's static and continuous schedulers, the vLLM engine on
    CPU and on CUDA. Each policy declares its set (`Policy.runtimes`); the vLLM engine refuses a
    request for a policy that does not declare its platform (`vllm/batch_rows.py`)."""

    # the vLLM ones are "vllm-" + the platform's name (`vllm/batch_rows.vllm_platform`)
    NATIVE_STATIC = "native-static"
    NATIVE_CONTINUOUS = "native-continuous"
    VLLM_CPU = "vllm-cpu"
    VLLM_CUDA = "vllm-cuda"
    NATIVE = frozenset({NATIVE_STATIC, NATIVE_CONTINUOUS})
    VLLM = frozenset({VLLM_CPU, VLLM_CUDA})
    ALL = NATIVE | VLLM


@dataclass
class PolicyConfig:
    """Base for small dataclass configs; subclasses add their knobs with defaults."""


class PolicyHooks(Protocol):
    """The hooks one policy (one axis) answers; `policies.base.Policy` gives every one a default."""

    name: str
    axis: str

    def capacity(self, prompt_lens: list[int], max_new: int) -> int | None: ...

    def begin(self, batch: BatchState) -> None: ...

    def before_step(self, batch: BatchState) -> None: ...

    def steer(self, layer: int, hidden: torch.Tensor, batch: BatchState) -> torch.Tensor: ...

    def prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          batch: BatchState) -> torch.Tensor | None: ...

    def decode_attention(self, layer: int, q: torch.Tensor, batch: BatchState) -> torch.Tensor | None: ...

    def after_forward(self, batch: BatchState) -> None: ...

    def telemetry(self, slot: int) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...

    def graph_ready(self) -> bool: ...

    def kernel_dense(self) -> bool: ...

    def pooled_form(self, pool: PoolView) -> PooledForm | None: ...


class PoolView(Protocol):
    """What a pooled form is built over: the continuous engine's KV pool (`pooled_decode.SlotPool`),
    one page of `length` entries per slot at fixed addresses, the last slot the pad slot."""

    length: int  # cache entries per slot
    num_heads: int  # the model's query heads
    scaling: float  # the attention scale

    @property
    def k(self) -> torch.Tensor: ...  # keys [layers, slots + 1, kv_heads, length, head_dim]

    @property
    def v(self) -> torch.Tensor: ...  # values, the same shape

    @property
    def tokenizer(self) -> Any: ...

    def capacity(self, kind: str, default: int) -> int:
        """Entries per KV head that the runtime of `kind` holds for one sequence: the engine's
        setting for that kind (`ContinuousEngine(pool_capacity=...)`) or the form's `default`,
        at most a slot's length."""
        ...


class PooledForm(Protocol):
    """One policy's runtime inside the pooled decode step: its state for every slot of the pool
    at fixed addresses, shared by all of that policy's sequences. The engine calls, per sequence,
    `fits` at admission, `join` (through the sequence's `BatchState.pool_slot`, from the policy's
    `begin`) and `leave` when it ends; per step, outside a captured graph, `before_step` and then
    `write_rows` (or `clear_rows` for a capture's warm-up); inside the step, per layer, `attend`."""

    def fits(self, config: PolicyConfig, need: int) -> bool:
        """Whether a sequence with these options and at most `need` cache entries can join."""
        ...

    def join(self, config: PolicyConfig, slot: int, prompt_len: int) -> Any:
        """The sequence in pool slot `slot` joins; returns what its policy keeps as its runtime."""
        ...

    def leave(self, slot: int) -> None: ...

    def before_step(self) -> None:
        """Once per pooled step with rows of this kind, before the policies' `before_step`."""
        ...

    def write_rows(self, order: Sequence[int]) -> None:
        """Lay out this step's rows: `order[r]` is the pool slot of row r (a slot of another kind
        or the pad slot: a row this form leaves alone)."""
        ...

    def clear_rows(self) -> None:
        """No row of this kind (a capture's warm-up), this step's plans kept."""
        ...

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """One layer's attention of this kind's rows: q, out [rows, Hq, D]; writes out[r] of its
        rows only (the others hold the dense launch's output)."""
        ...
