"""The worker: drives one engine from a `JobQueue` (claim, decode, publish, acknowledge).

`group_worker.py` (`Worker`: a claimed group runs to its end), `continuous.py` (`ContinuousWorker`: a
job joins whenever a slot is free; `make_worker` picks one for `--scheduler`), `events.py` (the
stream's events, shared by both), `main.py` (`cotserve worker`, the embedded worker thread,
`EngineArgs`), `metrics.py` (the worker's Prometheus metrics; no torch, the gateway shares its
buckets).

The names below load their module on first use, so importing a torch-free part (`main`'s
`EngineArgs`, say) does not load the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Worker": "group_worker", "HEARTBEAT_MISSES": "group_worker",
    "ContinuousWorker": "continuous", "make_worker": "continuous", "SCHEDULERS": "continuous",
    "delta_event": "events", "done_event": "events", "diverged_error": "events", "published_state": "events",
    "EngineArgs": "main", "make_engine": "main", "run_worker": "main", "start_worker_thread": "main",
    "WorkerMetrics": "metrics",
}
__all__ = [
    "HEARTBEAT_MISSES", "SCHEDULERS", "ContinuousWorker", "EngineArgs", "Worker", "WorkerMetrics", "delta_event",
    "diverged_error", "done_event", "make_engine", "make_worker", "published_state", "run_worker",
    "start_worker_thread",
]

if TYPE_CHECKING:
    from cotserve.worker.continuous import SCHEDULERS, ContinuousWorker, make_worker
    from cotserve.worker.events import delta_event, diverged_error, done_event, published_state
    from cotserve.worker.group_worker import HEARTBEAT_MISSES, Worker
    from cotserve.worker.main import EngineArgs, make_engine, run_worker, start_worker_thread
    from cotserve.worker.metrics import WorkerMetrics


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
