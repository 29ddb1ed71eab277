"""In-process queue: the embedded default (`cotserve serve` without `--redis-url`).

Same semantics as `RedisQueue`, kept in Python structures behind one lock. Gateway coroutines
wait on asyncio events that worker threads set through the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cotserve.queue.base import Job, JobQueue, QueueFull, group_key, kv_need, pick_group


@dataclass
class _Entry:
    job: Job
    state: str = "pending"  # pending | claimed | done | cancelled
    worker: str = ""
    cancel: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    finished_at: float = 0.0
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


class InProcessQueue(JobQueue):
    def __init__(self, result_ttl: float = 300.0):
        self.result_ttl = result_ttl
        self._lock = threading.Lock()
        self._jobs: dict[str, _Entry] = {}
        self._pending: dict[str, float] = {}  # job id -> enqueue time
        self._hb: dict[str, float] = {}  # worker id -> heartbeat expiry

    # -- gateway side ----------------------------------------------------------------------
    async def submit(self, job: Job, max_pending: int) -> None:
        with self._lock:
            self._sweep()
            if len(self._pending) >= max_pending:
                raise QueueFull(retry_after=1.0)
            self._jobs[job.id] = _Entry(job)
            self._pending[job.id] = job.created

    async def read(self, job_id: str, after: str, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        start = int(after)
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None:
                return []
            if len(entry.events) > start:
                return [(str(i + 1), e) for i, e in enumerate(entry.events[start:], start)]
            waiter = (loop, asyncio.Event())
            entry.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                if waiter in entry.waiters:
                    entry.waiters.remove(waiter)
        with self._lock:
            return [(str(i + 1), e) for i, e in enumerate(entry.events[start:], start)]

    async def cancel(self, job_id: str) -> None:
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None:
                return
            entry.cancel = True
            if entry.state == "pending":
                self._pending.pop(job_id, None)
                entry.state = "cancelled"
                entry.finished_at = time.time()

    async def state(self, job_id: str) -> str | None:
        with self._lock:
            entry = self._jobs.get(job_id)
            return None if entry is None else entry.state

    async def stats(self) -> dict[str, int]:
        with self._lock:
            now = time.time()
            running = sum(1 for e in self._jobs.values() if e.state == "claimed")
            return {"pending": len(self._pending), "running": running,
                    "workers": sum(1 for t in self._hb.values() if t > now)}

    async def ping(self) -> bool:
        return True

    # -- worker side -----------------------------------------------------------------------
    def claim(self, worker_id: str, max_batch: int, max_wait: float, max_tokens: int | None = None) -> list[Job]:
        with self._lock:
            if not self._pending:
                return []
            # the first in priority order (lower first, then the oldest), as the Redis queue orders it
            oldest_id = min(self._pending, key=lambda j: (self._jobs[j].job.priority, self._pending[j], j))
            oldest = self._jobs[oldest_id].job
            same = [(j, self._jobs[j].job.prompt_len) for j in self._pending
                    if j != oldest_id and group_key(self._jobs[j].job) == group_key(oldest)]
            need = None
            if max_tokens is not None:
                need = {j: kv_need(self._jobs[j].job) for j in [oldest_id, *(j for j, _ in same)]}
            ids = pick_group((oldest_id, oldest.prompt_len), same, max_batch, max_tokens, need)
            # still filling: every waiting job fits and there is room for more
            if len(ids) == len(same) + 1 < max_batch and time.time() - self._pending[oldest_id] < max_wait:
                return []
            now = time.time()
            out = []
            for jid in ids:
                self._pending.pop(jid)
                entry = self._jobs[jid]
                entry.state, entry.worker = "claimed", worker_id
                entry.job.attempts += 1
                entry.job.claimed_at = now
                out.append(Job.from_json(entry.job.to_json(), entry.job.attempts, now))
            return out

    def publish(self, worker_id: str, job_id: str, events: list[dict[str, Any]], after: int | None = None) -> bool:
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None or entry.state != "claimed" or entry.worker != worker_id:
                return False
            if after is not None and len(entry.events) >= after + len(events):
                return True  # a repeated call: these events are there already
            entry.events.extend(events)
            for loop, ev in entry.waiters:
                loop.call_soon_threadsafe(ev.set)
            return True

    def published(self, job_id: str) -> list[dict[str, Any]]:
        with self._lock:
            entry = self._jobs.get(job_id)
            return list(entry.events) if entry else []

    def finish(self, worker_id: str, job_id: str, state: str = "done") -> None:
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is not None and entry.worker == worker_id and entry.state == "claimed":
                entry.state = state
                entry.finished_at = time.time()

    def cancelled(self, job_ids: list[str]) -> set[str]:
        with self._lock:
            return {j for j in job_ids if (e := self._jobs.get(j)) is not None and e.cancel}

    def heartbeat(self, worker_id: str, ttl: float) -> None:
        with self._lock:
            self._hb[worker_id] = time.time() + ttl

    def reap(self) -> list[str]:
        with self._lock:
            now = time.time()
            dead = {w for w, t in self._hb.items() if t <= now}
            return self._requeue(dead)

    def live_workers(self) -> list[str]:
        with self._lock:
            now = time.time()
            return sorted(w for w, t in self._hb.items() if t > now)

    def leave(self, worker_id: str) -> None:
        with self._lock:
            self._hb.pop(worker_id, None)
            self._requeue({worker_id})

    def _requeue(self, workers: set[str]) -> list[str]:
        out = []
        for w in workers:
            self._hb.pop(w, None)
        for jid, e in self._jobs.items():
            if e.state == "claimed" and e.worker in workers:
                if e.cancel:
                    e.state, e.finished_at = "cancelled", time.time()
                else:
                    e.state, e.worker = "pending", ""
                    self._pending[jid] = e.job.created
                    out.append(jid)
        return out

    def _sweep(self) -> None:
        """Forget finished jobs older than result_ttl (the in-process form of expiry)."""
        cutoff = time.time() - self.result_ttl
        for jid in [j for j, e in self._jobs.items() if e.finished_at and e.finished_at < cutoff]:
            del self._jobs[jid]
