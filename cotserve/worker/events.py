"""The events a worker publishes on a job's stream, shared by the static and continuous loops.

`delta` (new token ids and text, logprobs when asked), `done` (finish reason, usage, telemetry)
and the `error` of a resumed job whose retry diverged; `published_state` reads back what earlier
attempts of a job already published (resuming after a lost worker). `default_worker_id` names a
worker (the `worker` of its `done` events).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from cotserve.queue.base import Job


def default_worker_id() -> str:
    """A worker's name in the queue, its events and its metrics when none is given: host-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Resume:
    """What earlier attempts already published for one job."""

    ids: list[int] = field(default_factory=list)
    text_len: int = 0
    seen_ids: int = 0  # regenerated so far
    seen_text: int = 0
    failed: bool = False


def diverged_error() -> dict[str, Any]:
    """The error event of a resumed job whose retry produced tokens other than those published."""
    return {"t": "error", "status": 500, "code": "worker_lost",
            "message": "the worker running this request stopped mid-stream and the retry produced different "
                       "tokens; retry the request"}


def delta_event(ids: list[int], text: str, logprobs, index: int, n: int) -> dict[str, Any]:
    """A `delta` event: new token ids and text, their logprobs when asked, the choice index when n > 1."""
    ev: dict[str, Any] = {"t": "delta", "ids": ids, "text": text}
    if logprobs is not None and ids:
        ev["lp"] = _lp_event(logprobs[len(logprobs) - len(ids):])
    if n > 1:
        ev["i"] = index
    return ev


def done_event(job: Job, res, index: int, n: int, worker_id: str) -> dict[str, Any]:
    """A sequence's `done` event: finish reason, usage and telemetry (with the queue wait, the
    attempt and the worker)."""
    tele = dict(res.telemetry)
    tele["queue_wait_s"] = round(max(0.0, job.claimed_at - job.created), 4)
    tele["attempt"] = job.attempts
    tele["worker"] = worker_id
    done: dict[str, Any] = {"t": "done", "finish_reason": res.finish_reason,
                            "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens},
                            "telemetry": tele}
    if n > 1:
        done["i"] = index
    return done


def published_state(events: list[dict[str, Any]], n: int = 1) -> tuple[Resume, bool]:
    """What was published for a job of `n` sequences; ended once all n are done (or on an error)."""
    st = Resume()
    done = 0
    ended = False
    for e in events:
        if e.get("t") == "delta":
            st.ids.extend(e.get("ids", []))
            st.text_len += len(e.get("text", ""))
        elif e.get("t") == "done":
            done += 1
        elif e.get("t") == "error":
            ended = True
    return st, ended or done >= n


def _lp_event(lps: list[tuple[float, list[tuple[int, float]]]]) -> list[list[Any]]:
    """Logprobs as JSON: [[logprob, [[id, logprob], ...]], ...] per token."""
    return [[round(lp, 6), [[i, round(v, 6)] for i, v in top]] for lp, top in lps]
