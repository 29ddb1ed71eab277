"""The continuous worker (`--scheduler continuous`): claims a job whenever a slot is free.

The static `Worker` claims a group, runs it to its end and only then claims again. This one
drives a `ContinuousEngine`: before every engine step it claims as many jobs as it has free slots
(the queue hands out the oldest job and the closest prompt lengths with the same policy key, as
for the static worker; with nothing running it lets a group fill for `--batch-wait` first, with
sequences running it claims at once), submits them, runs one step and publishes that step's
deltas. A cancelled job leaves the engine at the next step and its slot goes to the next job.

On an engine that batches by itself (vLLM: `engine.open_pool()`, `vllm/pool.py`) the pool hands
each claimed sequence to it at once; the worker claims again whenever it has room (free sequence
slots, and the KV tokens it last reported free, less what was submitted since, cover the job) and
publishes whatever output arrived, one event per request per engine step at most. A sequence that
fails there fails its own job alone.

Everything else (heart-beats, reaping, deadlines, resuming a job after a lost worker, `n`
sequences per job, logprobs, request logs) follows the static worker (`worker/group_worker.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cotserve.engine.continuous import ContinuousEngine
from cotserve.engine.native import Delta, NativeEngine
from cotserve.engine.replay import ReplayText
from cotserve.errors import CotserveError, EngineDead, RequestError
from cotserve.policies.registry import build_policy
from cotserve.queue.base import Job, JobQueue, kv_need
from cotserve.worker.events import Resume, delta_event, diverged_error, done_event
from cotserve.worker.group_worker import Worker
from cotserve.worker.metrics import WorkerMetrics

log = logging.getLogger("cotserve.worker")


@dataclass
class _Running:
    """A claimed job in the engine: its sequences still running and what was published."""

    job: Job
    n: int
    left: int
    resume: Resume | None = None
    lost: bool = False
    first_token_at: float | None = None
    request_ids: list[str] = field(default_factory=list)


class ContinuousWorker(Worker):
    scheduler = "continuous"

    def __init__(self, engine: NativeEngine, queue: JobQueue, worker_id: str | None = None,
                 max_batch: int | None = None, max_wait: float = 0.02, heartbeat_s: float = 1.0,
                 poll_s: float = 0.01, cancel_poll_s: float = 0.05, prefill_chunk: int = 256,
                 stats_s: float = 10.0, metrics: WorkerMetrics | None = None, pool_len: int = 4096,
                 restart: Callable[[], Any] | None = None, restarts: int = 3, restart_backoff_s: float = 1.0,
                 replay: ReplayText | None = None):
        super().__init__(engine, queue, worker_id=worker_id, max_batch=max_batch, max_wait=max_wait,
                         heartbeat_s=heartbeat_s, poll_s=poll_s, cancel_poll_s=cancel_poll_s, stats_s=stats_s,
                         metrics=metrics, restart=restart, restarts=restarts, restart_backoff_s=restart_backoff_s,
                         replay=replay)
        self.prefill_chunk = prefill_chunk
        self.pool_len = pool_len
        self.pool = self._new_pool()
        self._jobs: dict[str, _Running] = {}
        self._seq: dict[str, tuple[str, int]] = {}  # request id -> (job id, sequence index)
        self._last_cancel_poll = 0.0

    def _new_pool(self) -> Any:
        open_pool = getattr(self.engine, "open_pool", None)
        if open_pool is not None:  # an engine that batches by itself (vLLM)
            return open_pool(self.max_batch)
        return ContinuousEngine(self.engine, slots=self.max_batch, prefill_chunk=self.prefill_chunk,
                                pool_len=self.pool_len)

    def _claim_budget(self) -> tuple[bool, int | None]:
        """(claim now?, at most this many KV tokens): a pool that knows the engine's free KV
        capacity (vLLM) takes no new job while that is used up and sequences still run."""
        budget_of = getattr(self.pool, "kv_budget", None)
        if budget_of is None:
            return True, None
        try:
            budget = budget_of()
        except Exception:  # a capacity report must never stop the worker: claim by count
            log.warning("the engine's KV capacity report failed", exc_info=True)
            return True, None
        if budget is not None and budget <= 0 and not self.pool.idle:
            return False, None
        return True, budget

    def run_once(self) -> int:
        """Reap now and then, claim jobs for the free slots, run one engine step; returns the
        number of jobs claimed plus one when a step ran (0: idle)."""
        now = time.time()
        if now - self._last_reap >= self.heartbeat_s and now - self._queue_failed_at >= self.lease_s:
            self._last_reap = now
            for jid in self.queue.reap():
                log.warning("job %s returned to pending (its worker stopped heart-beating)", jid)
        claimed = 0
        free = self.pool.free_slots()
        go, budget = self._claim_budget() if free > 0 else (False, None)
        if go:
            jobs = self.queue.claim(self.worker_id, free, self.max_wait if self.pool.idle else 0.0,
                                    max_tokens=budget)
            for i, job in enumerate(jobs):
                try:
                    self._start(job)
                except EngineDead:
                    self._lose_engine(jobs[i:])
                    return len(jobs)
            claimed = len(jobs)
        self._running = set(self._jobs)  # the heartbeat renews these jobs' leases
        if self.pool.idle:
            return claimed
        self._poll_cancelled()
        try:
            deltas = self.pool.step()
        except Exception as exc:
            if self.engine_is_dead(exc):
                self._lose_engine()
            else:  # never let one bad step kill the worker or fail the requests beside the bad one
                log.exception("an engine step of %d request(s) failed; running them one by one", len(self._jobs))
                self._run_alone([run.job for run in self._jobs.values()])
            return claimed + 1
        self._publish_deltas(deltas)
        self._running = set(self._jobs)
        return claimed + 1

    def _drop_all(self) -> list[Job]:
        """Forget every running job (the pool is replaced); returns them."""
        jobs = [run.job for run in self._jobs.values()]
        self._jobs.clear()
        self._seq.clear()
        self._last_token_at.clear()
        self._running = set()
        return jobs

    def _run_alone(self, jobs: list[Job]) -> None:
        """After a failed step: a new pool, and each job of the old one run again on its own (the
        static path, resuming after what its stream already has), so only the job that fails alone
        gets the error."""
        self._drop_all()
        self.pool = self._new_pool()
        for i, job in enumerate(jobs):
            self._running = {job.id}
            try:
                self._run_guarded([job], alone=True)
            except EngineDead:
                self._engine_died(jobs[i:])
                return
            finally:
                self._running = set()
            self.jobs_done += 1

    def _lose_engine(self, unstarted: list[Job] | None = None) -> None:
        jobs = {j.id: j for j in self._drop_all() + list(unstarted or [])}
        self._engine_died(list(jobs.values()))

    def _engine_restarted(self) -> None:
        self.pool = self._new_pool()

    # -- intake ----------------------------------------------------------------------------
    def _start(self, job: Job) -> None:
        sampling = dict(job.sampling)
        n = int(sampling.pop("n", 1) or 1)
        go, resume = self._intake(job, n)
        if not go:
            return
        try:
            copies = self._copies(job, n, sampling)
            self.engine.check_request(copies[0])
        except RequestError as exc:
            self._error(job, 400, exc.code or "invalid_request_error", str(exc))
            return
        try:
            stacks = [build_policy(job.policy, job.options) for _ in copies]  # one stack per sequence
            check = getattr(self.engine, "check_policy", None)
            if check is not None:
                check(stacks[0])
        except CotserveError as exc:
            self._error(job, 400, "invalid_policy", str(exc))
            return
        run = _Running(job, n, n, resume, request_ids=[r.request_id for r in copies])
        self._jobs[job.id] = run
        kv_aware = hasattr(self.pool, "kv_budget")
        for i, (req, stack) in enumerate(zip(copies, stacks, strict=True)):
            self._seq[req.request_id] = (job.id, i)
            if kv_aware:
                self.pool.submit(req, stack, need=kv_need(job) // n)
            else:
                self.pool.submit(req, stack)

    def _poll_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < self.cancel_poll_s or not self._jobs:
            return
        self._last_cancel_poll = now
        for jid in self._q(self.queue.cancelled, list(self._jobs)):
            for rid in self._jobs[jid].request_ids:
                self.pool.cancel(rid)

    # -- output ----------------------------------------------------------------------------
    def _publish_deltas(self, deltas: list[Delta]) -> None:
        for d in deltas:
            jid, index = self._seq.get(d.request_id, ("", 0))
            run = self._jobs.get(jid)
            if run is None:  # a lost job's sequences ending
                if d.result is not None:
                    self._seq.pop(d.request_id, None)
                continue
            if run.lost:
                if d.result is not None:
                    self._seq.pop(d.request_id, None)
                continue
            job, n = run.job, run.n
            if d.error is not None:  # this sequence failed on its own: its job fails, the others go on
                self._seq.pop(d.request_id, None)
                self._last_token_at.pop(d.request_id, None)
                self._fail_job(run, d.error, d.refused)
                continue
            events: list[dict[str, Any]] = []
            ids, text = list(d.token_ids), d.text
            st = run.resume
            if st is not None and not st.failed:
                ids, text = self._skip_published(st, ids, text)
                if st.failed:
                    events.append(diverged_error())
                    run.lost = True
            sent = 0
            if not run.lost and (ids or text):
                events.append(delta_event(ids, text, d.logprobs, index, n))
                if run.first_token_at is None:
                    run.first_token_at = time.time()
                sent = len(ids)
            if d.result is not None and not run.lost:
                events.append(done_event(job, d.result, index, n, self.worker_id))
            if events and not self._publish(jid, events):  # retried through outages, idempotent
                run.lost = True  # reaped and handed on: stop decoding it here
            elif sent:
                self._sent(d.request_id, sent)
            if d.result is not None:
                self._seq.pop(d.request_id, None)
                self._last_token_at.pop(d.request_id, None)
            if run.lost:
                self._end_lost(run)
            elif d.result is not None:
                run.left -= 1
                if run.left == 0:
                    del self._jobs[jid]
                    self.jobs_done += 1
                    state = "cancelled" if d.result.finish_reason == "cancelled" else "done"
                    self._q(self.queue.finish, self.worker_id, jid, state)
                    self._stream_len.pop(jid, None)
                    self._log_request(job, d.result.finish_reason, d.result.prompt_tokens,
                                      d.result.completion_tokens, run.first_token_at, d.result.telemetry)

    def _fail_job(self, run: _Running, message: str, refused: bool = False) -> None:
        """One of the job's sequences failed in the engine: the job ends with an error event (its
        other sequences are stopped; a 400 when the engine refused the request as invalid, else a
        500); every other job goes on."""
        if self._jobs.pop(run.job.id, None) is None:
            return
        log.warning("request %s failed in the engine: %s", run.job.id, message)
        for rid in run.request_ids:
            if rid in self._seq:
                self.pool.cancel(rid)
                self._seq.pop(rid, None)
        if refused:
            self._error(run.job, 400, "invalid_request_error", message)
        else:
            self._error(run.job, 500, "server_error", f"{message}; the server log has the details")
        self._stream_len.pop(run.job.id, None)
        self.jobs_done += 1

    def _end_lost(self, run: _Running) -> None:
        """A job this worker no longer owns (or whose retry diverged): stop its sequences, free
        their slots, acknowledge it as failed once."""
        if self._jobs.pop(run.job.id, None) is None:
            return
        for rid in run.request_ids:
            self.pool.cancel(rid)
            self._last_token_at.pop(rid, None)
        self._q(self.queue.finish, self.worker_id, run.job.id, "failed")
        self._stream_len.pop(run.job.id, None)
        self.jobs_done += 1


SCHEDULERS = ("continuous", "static")


def make_worker(engine: Any, queue: JobQueue, scheduler: str = "continuous", prefill_chunk: int = 256,
                pool_len: int = 4096, **kwargs: Any) -> Worker:
    """The worker for `--scheduler`: continuous (a job joins whenever the engine has room: the
    native engine's slots, or vLLM's own batch through `engine.open_pool()`) or static (a claimed
    group runs to its end before the next claim)."""
    if scheduler not in SCHEDULERS:
        raise CotserveError(f"unknown scheduler {scheduler!r} (continuous or static)")
    if scheduler == "continuous" and (isinstance(engine, NativeEngine) or hasattr(engine, "open_pool")):
        return ContinuousWorker(engine, queue, prefill_chunk=prefill_chunk, pool_len=pool_len, **kwargs)
    return Worker(engine, queue, **kwargs)
