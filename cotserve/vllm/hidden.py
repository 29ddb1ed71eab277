"""The persistent buffer of the last forward's final hidden states (`HiddenBuffer`).

cotserve's model classes (`models.py`) copy into it at every forward once the worker has an
eviction runtime; SkipKV's sentence tracking reads it at the next step (`step_plan`). The copy is
a tensor op, so it is part of a captured CUDA graph. The process's one buffer is
`process.runtimes().hidden`.
"""

from __future__ import annotations

import torch


class HiddenBuffer:
    """The final hidden states [tokens, hidden] of the last forward (rows beyond it are stale)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def capture(self, hidden: torch.Tensor) -> None:
        n = hidden.shape[0]
        if self.buf is None or self.buf.shape[0] < n or self.buf.shape[1:] != hidden.shape[1:] \
                or self.buf.dtype != hidden.dtype or self.buf.device != hidden.device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # never allocate inside a capture (the profile run allocated at the largest size)
            self.buf = torch.empty_like(hidden)
        self.buf[:n].copy_(hidden)
