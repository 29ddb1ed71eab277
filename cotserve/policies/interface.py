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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from cotserve.engine.batch import BatchState


class Axis:
    """What a policy decides: which entries to READ, which to EVICT, or how to STEER."""

    READ = "read"
    EVICT = "evict"
    STEER = "steer"


class Runtime:
    """Where a policy runs: the native engine's static and continuous schedulers, the vLLM engine on
    CPU and on CUDA. Each policy declares its set (`Policy.runtimes`); the vLLM engine refuses a
    request for a policy that does not declare its platform (`vllm/requests.py`)."""

    # the vLLM ones are "vllm-" + the platform's name (`vllm/requests.vllm_platform`)
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
