"""Telling vLLM's failures apart: a dead engine (its engine process is gone; the worker restarts
it) from one request failing (that request alone ends with an error)."""

from __future__ import annotations


def is_engine_dead(exc: BaseException) -> bool:
    """Whether `exc` is vLLM's EngineDeadError."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError)
