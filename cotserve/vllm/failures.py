"""Telling vLLM's failures apart: a dead engine (its engine process is gone; the worker restarts
it) from one request failing (that request alone ends with an error)."""

from __future__ import annotations


def refusal(exc: BaseException) -> str | None:
    """vLLM's one-line reason when `exc` refuses the request itself (its client errors, and the
    ValueError that vLLM's request validation and logits processors raise); None otherwise."""
    from cotserve.vllm.compat import client_error_types

    if not isinstance(exc, client_error_types()):
        return None
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def is_engine_dead(exc: BaseException) -> bool:
    """Whether `exc` is vLLM's EngineDeadError."""
    from cotserve.vllm.compat import EngineDeadError

    return isinstance(exc, EngineDeadError)
