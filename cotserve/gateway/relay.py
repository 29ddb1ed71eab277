"""Between a request and the queue: readiness, enqueueing, reading a job's events, cancelling a job
whose client went away, and running a job to its end (`JobRelay`, one per app)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request

from cotserve.errors import redact_paths
from cotserve.gateway.errors import APIError
from cotserve.gateway.metrics import Metrics
from cotserve.queue.base import Job, JobQueue, QueueFull, QueueUnavailable

log = logging.getLogger("cotserve.gateway")

if TYPE_CHECKING:
    from cotserve.gateway.settings import GatewaySettings


class JobRelay:
    """The queue side of the routes, for one server (`settings`, `queue`, `metrics`)."""

    def __init__(self, settings: GatewaySettings, queue: JobQueue, metrics: Metrics):
        self.settings = settings
        self.queue = queue
        self.metrics = metrics
        self._ready_at = 0.0  # when the last positive readiness answer came

    async def readiness(self) -> tuple[bool, str, dict[str, int]]:
        ok, why, stats = await self._check()
        if not ok:
            self._ready_at = 0.0  # a negative answer voids the trusted positive one at once
        return ok, why, stats

    async def _check(self) -> tuple[bool, str, dict[str, int]]:
        try:
            if not await self.queue.ping():
                return False, "the queue backend does not answer", {}
            stats = await self.queue.stats()
        except Exception as exc:
            return False, f"the queue backend does not answer: {type(exc).__name__}", {}
        if stats.get("workers", 0) < 1:
            return False, "no worker is ready (the model may still be loading)", stats
        return True, "ready", stats

    async def request_ready(self) -> None:
        """503 unless ready; a positive answer is trusted for a second (saves queue round trips),
        unless a readiness check (/ready, or another request) has answered negatively since."""
        if time.monotonic() - self._ready_at < 1.0:
            return
        ok, why, _ = await self.readiness()
        if not ok:
            raise APIError(503, why, code="not_ready", headers={"Retry-After": "1"})
        self._ready_at = time.monotonic()

    async def submit(self, job: Job) -> None:
        """Readiness check, then enqueue (429 when the queue is full); counts the request in flight."""
        await self.request_ready()
        try:
            await self.queue.submit(job, self.settings.max_pending)
        except QueueFull as exc:
            raise APIError(429, "the queue is full; retry later", code="queue_full",
                           headers={"Retry-After": str(max(1, int(exc.retry_after)))}) from exc
        except QueueUnavailable as exc:
            raise APIError(503, str(exc), code="queue_unavailable", headers={"Retry-After": "1"}) from exc
        self.metrics.in_flight.inc()
        fields = {"request_id": job.id, "x_request_id": job.client_request_id, "policy": job.policy,
                  "prompt_tokens": len(job.prompt_ids)}
        log.info("enqueued " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None), extra=fields)

    async def events(self, job: Job, request: Request, n: int = 1) -> AsyncIterator[dict[str, Any]]:
        """The job's events until its n sequences are done (or an error); cancels the job when the
        client goes away (shielded: also on cancellation).

        While nothing arrives it yields {"t": "ping"} every `keepalive_s` when that is set (streams
        send an SSE comment), ends with a 503 `queue_timeout` once the job has waited `queue_timeout` seconds
        without a worker (queued, or handed back after its worker was lost), and rides out an
        unreachable queue for `queue_outage_s` seconds, retrying with backoff. An error event's
        message has its file paths shortened (`redact_paths`): whichever worker wrote it, no path
        of its machine reaches the client."""
        after = "0"
        finished = False
        done = 0
        start = time.monotonic()
        last_check = last_event = last_state = start
        pending_since: float | None = start
        outage_since: float | None = None
        try:
            while True:
                try:
                    evs = await self.queue.read(job.id, after, self.settings.poll_s)
                    outage_since = None
                except QueueUnavailable as exc:
                    now = time.monotonic()
                    outage_since = outage_since or now
                    if now - outage_since >= self.settings.queue_outage_s:
                        raise APIError(503, f"the queue has been unreachable for {now - outage_since:.0f} s",
                                       code="queue_unavailable") from exc
                    await asyncio.sleep(min(1.0, 0.05 + (now - outage_since) / 4))
                    evs = []
                for eid, ev in evs:
                    after = eid
                    if ev.get("t") == "error" and isinstance(ev.get("message"), str):
                        ev = {**ev, "message": redact_paths(ev["message"])}  # whichever worker wrote it
                    if ev.get("t") == "error" and ev.get("code") == "engine_failed":
                        self._ready_at = 0.0  # the next request asks the queue again
                    if ev.get("t") == "done":
                        done += 1
                    if ev.get("t") == "error" or done >= n:
                        finished = True
                    yield ev
                    if finished:
                        return
                now = time.monotonic()
                if evs:
                    last_event, pending_since = now, None
                else:
                    if self.settings.keepalive_s > 0 and now - last_event >= self.settings.keepalive_s:
                        last_event = now
                        yield {"t": "ping"}
                    if outage_since is None and now - last_state >= 1.0:
                        last_state = now
                        pending_since = await self.job_waits(job, pending_since, now)
                if not evs or now - last_check >= self.settings.poll_s:
                    last_check = now
                    if await request.is_disconnected():
                        return
        finally:
            if not finished:
                await asyncio.shield(self.cancel(job.id))

    async def job_waits(self, job: Job, pending_since: float | None, now: float) -> float | None:
        """Since when the job has been waiting without a worker (None while one runs it); raises
        the request's error once that is longer than the queue timeout, or when the queue lost the job."""
        try:
            state = await self.queue.state(job.id)
        except QueueUnavailable:
            return pending_since
        if state is None:
            raise APIError(503, "the queue lost this request (its backend restarted without its data); retry",
                           code="job_lost", headers={"Retry-After": "1"})
        if state != "pending":
            return None
        since = pending_since if pending_since is not None else now
        if self.settings.queue_timeout and now - since >= self.settings.queue_timeout:
            raise APIError(503, f"no worker took this request for {now - since:.0f} s (the server's "
                                "--queue-timeout); retry later", code="queue_timeout", headers={"Retry-After": "1"})
        return since

    async def cancel(self, job_id: str) -> None:
        self.metrics.cancelled.inc()
        await self.queue.cancel(job_id)

    async def collect(self, job: Job, request: Request, n: int, on_event: Callable[[dict[str, Any]], None]
                      ) -> tuple[list[dict[str, Any]], float]:
        """Run a job to its end, handing each delta/done event to `on_event`; returns the done
        events (by choice index) and the latency."""
        clock = self.metrics.clock()
        dones: list[dict[str, Any] | None] = [None] * n
        gen = self.events(job, request, n)
        try:
            async for ev in gen:
                if ev["t"] == "ping":
                    continue
                if ev["t"] == "error":
                    raise APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                on_event(ev)
                if ev["t"] == "delta":
                    clock.tokens(ev.get("i", 0), len(ev.get("ids") or ()))
                if ev["t"] == "done":
                    dones[ev.get("i", 0)] = ev
        finally:
            await gen.aclose()
        if any(d is None for d in dones):  # the client went away; nobody reads this
            raise APIError(499, "the client disconnected; the request was cancelled", code="cancelled",
                           type_="invalid_request_error")
        latency = clock.finish()
        for d in dones:
            self.metrics.observe_done(d["usage"], d.get("telemetry", {}), d.get("finish_reason"))
        return dones, latency

    @staticmethod
    async def guard(gen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """Turn a backend failure mid-stream into an in-stream error event."""
        try:
            async for ev in gen:
                yield ev
        except APIError as exc:
            yield {"t": "error", "status": exc.status, "code": exc.code, "message": exc.message}
