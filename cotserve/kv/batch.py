"""Per-batch state shared by the engines and the policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cotserve.kv.cache import KVCache


@dataclass
class ModelInfo:
    """Shapes and vocabulary facts a policy may need."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int
    tokenizer: Any = None
    model_name: str = ""
    weight_dtype: torch.dtype | None = None  # the linear layers' dtype when narrower than the compute dtype (bf16w)


@dataclass
class BatchState:
    """What one forward pass (and the policies' hooks) can see.

    mode: "prefill" or "decode".
    positions: true position of each slot's current token (decode) [B].
    prompt_lens: prompt length per slot [B].
    tokens: every token id per slot so far (prompt + generated), for boundary logic.
    hidden: the last layer's output of the latest forward [B, T, H] (after the final norm).
    """

    info: ModelInfo
    cache: KVCache
    policy: Any  # the request's policy stack (`policies.base.PolicyStack`): the engine hands it through
    scaling: float
    prompt_lens: torch.Tensor
    tokens: list[list[int]]
    mode: str = "prefill"
    step: int = 0
    positions: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    active: torch.Tensor | None = None  # bool [B]: slots still generating
    extras: dict[str, Any] = field(default_factory=dict)  # per-request policy inputs, by slot
    cuda_graphs: bool = False  # the engine captures the decode step in a CUDA graph where the stack allows it
    lean: bool = True  # the engine's lean decoder stack may run (no forward hook registered when the batch began)
    # the continuous engine's pool slot (`pooled_decode.PoolSlot`) when this one-slot batch decodes in
    # the pool's fixed-shape step; a policy whose fast step joins that step (SFI) attaches there
    pool_slot: Any = None

    @property
    def batch_size(self) -> int:
        return self.prompt_lens.shape[0]
