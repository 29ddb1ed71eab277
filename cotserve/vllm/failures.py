"""Telling vLLM's failures apart: a dead engine (its engine process is gone; the worker restarts
it) from one request failing (that request alone ends with an error)."""

from __future__ import annotations


def refusal(exc: BaseException) -> str | None:
    """vLLM's one-line reason when `exc` refuses the request itself (its client errors, and the
    ValueError that vLLM's request validation and logits processors raise); None otherwise."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # vLLM versions before the client/server error split
        VLLMClientError = ValueError  # noqa: N806
    if not isinstance(exc, (VLLMClientError, ValueError)):
        return None
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def is_engine_dead(exc: BaseException) -> bool:
    """Whether `exc` is vLLM's EngineDeadError."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)
