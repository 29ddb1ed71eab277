"""`LoadedModel`: a model, its tokenizer, device and dtypes, ready for the native engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LoadedModel:
    """A model ready for the native engine."""

    name: str
    path: Path
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    weight_dtype: torch.dtype | None = None  # linear weights' dtype when narrower than `dtype`

    @property
    def config(self):
        return self.model.config
