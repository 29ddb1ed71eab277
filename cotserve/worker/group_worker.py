"""The group worker (`--scheduler static`): drives one `NativeEngine` from a `JobQueue`, a claimed
group of jobs at a time, each group run to its end.

Loop: heart-beat (own thread), reap dead workers' jobs now and then, claim a group of jobs with
the same policy key and similar prompt length (at most max_batch jobs and, when the engine reports
its free KV capacity as vLLM does, at most that many KV tokens), run them as one batch through
`engine.stream`, publish each step's token deltas, then a final `done` event (usage + telemetry)
per job, and acknowledge. Cancellation flags are polled between steps; a cancelled job stops
decoding at once.

Resuming after a worker died mid-job: the job comes back with attempts > 1 and the events the
dead worker already published are on its stream. Greedy and seeded sampling reproduce the same
tokens, so the new worker regenerates the job and publishes only what lies beyond the published
token ids and text; while regenerating it checks the token ids against the published ones, and
if they differ (numerics of another batch, say) or the job's sampling is unseeded (not
reproducible), the client gets an `error` event instead of a silently different or repeated
stream. The gateway gives every sampled request without a seed a server-drawn seed, so in practice
only a divergence ends a resumed stream with an error.

Queue outages (a Redis restart): every queue call the worker makes while running a group is
retried with backoff for up to `outage_s` seconds, so decoding pauses and goes on where it was;
the heartbeat thread also renews the leases of the running jobs. After an outage the worker waits
one lease before it reaps anyone (every live worker renews its heartbeat and leases by then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cotserve.engine.native import GenRequest, NativeEngine
from cotserve.engine.replay import ReplayText
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import CotserveError, EngineDead, PolicyError, RequestError, redact_paths
from cotserve.model_names import model_slug
from cotserve.policies.registry import build_policy
from cotserve.queue.base import Job, JobQueue, QueueUnavailable
from cotserve.worker.events import (
    Resume,
    default_worker_id,
    delta_event,
    diverged_error,
    done_event,
    published_state,
)
from cotserve.worker.metrics import WorkerMetrics

log = logging.getLogger("cotserve.worker")
# One line per finished request (done, cancelled or failed); its fields also go to JSON logs.
request_log = logging.getLogger("cotserve.requests")

# A worker whose heartbeat is this many periods old counts as dead (room for a busy, shared machine).
HEARTBEAT_MISSES = 5
# A job that was running on this many engines that died is failed, not handed on again (a request
# that kills every engine it reaches must not take down one worker after another).
MAX_ENGINE_ATTEMPTS = 2


class Worker:
    scheduler = "static"

    def __init__(self, engine: NativeEngine, queue: JobQueue, worker_id: str | None = None,
                 max_batch: int | None = None, max_wait: float = 0.02, heartbeat_s: float = 1.0,
                 poll_s: float = 0.01, cancel_poll_s: float = 0.05, outage_s: float = 30.0,
                 stats_s: float = 10.0, metrics: WorkerMetrics | None = None,
                 restart: Callable[[], Any] | None = None, restarts: int = 3, restart_backoff_s: float = 1.0,
                 replay: ReplayText | None = None):
        self.engine = engine
        self.replay = replay  # benchmarks only (--bench-replay): each sequence's tokens follow this text
        # after the engine died: a new one from `restart()`, at most `restarts` tries, waiting
        # restart_backoff_s, then twice that, ...; without `restart` (or when every try fails) the
        # worker stops and `run` raises EngineDead
        self.restart = restart
        self.restarts = restarts
        self.restart_backoff_s = restart_backoff_s
        self.engine_restarts = 0
        self._paused = False  # no heartbeat while the engine is dead (readiness stops counting this worker)
        self.queue = queue
        self.worker_id = worker_id or default_worker_id()
        self.max_batch = max_batch or engine.max_batch
        self.max_wait = max_wait
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.cancel_poll_s = cancel_poll_s
        self.outage_s = outage_s
        self.stats_s = stats_s  # seconds between stats lines (0: none)
        self.metrics = metrics or WorkerMetrics(self.worker_id)
        self.metrics.track_running(lambda: len(self._running))
        self.metrics.track_vllm(self._vllm_stats, model_slug(getattr(engine, "model_spec", None)))
        self.stop_event = threading.Event()
        self.requests_finished = 0  # done, cancelled or failed (one request line each)
        self.tokens_generated = 0  # published
        self._stats_at = time.monotonic()
        self._stats_mark = (0, 0)  # (requests_finished, tokens_generated) at the last stats line
        self._last_token_at: dict[str, float] = {}  # sequence (request id) -> when its last tokens went out
        self.jobs_done = 0
        self._last_reap = 0.0
        self._running: set[str] = set()  # job ids of the group being decoded (their leases are renewed)
        self._queue_failed_at = 0.0  # when a queue call last failed (reaping waits a lease after that)
        self._stream_len: dict[str, int] = {}  # job id -> events on its stream (a retried publish is idempotent)

    @property
    def lease_s(self) -> float:
        return HEARTBEAT_MISSES * self.heartbeat_s

    def _q(self, fn, *args):
        """A queue call, retried with backoff while the queue is unreachable (up to outage_s)."""
        t0: float | None = None
        delay = 0.05
        while True:
            try:
                return fn(*args)
            except QueueUnavailable:
                now = time.monotonic()
                t0 = t0 if t0 is not None else now
                self._queue_failed_at = time.time()
                if now - t0 >= self.outage_s or self.stop_event.is_set():
                    raise
                log.warning("queue unreachable; retrying %s", getattr(fn, "__name__", "call"))
                self.stop_event.wait(delay)
                delay = min(1.0, delay * 2)

    # -- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `stop()`; then hand back unfinished jobs."""
        hb = threading.Thread(target=self._heartbeat_loop, name="cotserve-heartbeat", daemon=True)
        self.queue.heartbeat(self.worker_id, HEARTBEAT_MISSES * self.heartbeat_s)
        hb.start()
        try:
            while not self.stop_event.is_set():
                try:
                    busy = self.run_once()
                except EngineDead:
                    raise
                except QueueUnavailable as exc:  # Redis went away: keep trying, do not die
                    self._queue_failed_at = time.time()
                    log.warning("queue unreachable (%s); retrying", exc)
                    self.stop_event.wait(0.2)
                    continue
                except Exception:
                    log.exception("queue error; retrying in 1 s")
                    self.stop_event.wait(1.0)
                    continue
                if not busy:
                    self.stop_event.wait(self.poll_s)
        finally:
            self.stop_event.set()
            try:
                self.queue.leave(self.worker_id)
            except Exception:  # the backend may be gone at shutdown
                log.warning("could not leave the queue cleanly", exc_info=True)

    def stop(self) -> None:
        self.stop_event.set()

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(self.heartbeat_s):
            if self._paused:
                continue
            try:
                self.queue.heartbeat(self.worker_id, self.lease_s)
                self.queue.renew(self.worker_id, sorted(self._running), self.lease_s)
            except QueueUnavailable as exc:
                self._queue_failed_at = time.time()
                log.warning("heartbeat failed: %s", exc)
            except Exception:
                log.warning("heartbeat failed", exc_info=True)
            if self.stats_s > 0 and time.monotonic() - self._stats_at >= self.stats_s:
                self.log_stats()

    def log_stats(self) -> None:
        """One `cotserve.worker` line of what happened since the last one: requests running and
        finished, tokens generated and their rate (nothing while the worker is idle)."""
        now = time.monotonic()
        span = max(now - self._stats_at, 1e-9)
        finished = self.requests_finished - self._stats_mark[0]
        tokens = self.tokens_generated - self._stats_mark[1]
        running = len(self._running)
        self._stats_at, self._stats_mark = now, (self.requests_finished, self.tokens_generated)
        if not (finished or tokens or running):
            return
        fields = {"worker": self.worker_id, "scheduler": self.scheduler, "running": running, "finished": finished,
                  "generated_tokens": tokens, "tok_s": round(tokens / span, 1), "interval_s": round(span, 1),
                  "requests_total": self.requests_finished}
        log.info("stats " + " ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)

    def _sent(self, request_id: str, n: int) -> None:
        """`n` tokens of one sequence published: counted, and their gap since its previous ones."""
        now = time.monotonic()
        last = self._last_token_at.get(request_id)
        self._last_token_at[request_id] = now
        self.tokens_generated += n
        self.metrics.tokens(n, None if last is None else now - last)

    def run_once(self) -> int:
        """Reap (at most once per heartbeat period), claim one group and run it; returns its size."""
        now = time.time()
        if now - self._last_reap >= self.heartbeat_s and now - self._queue_failed_at >= self.lease_s:
            self._last_reap = now
            for jid in self.queue.reap():
                log.warning("job %s returned to pending (its worker stopped heart-beating)", jid)
        jobs = self.claim_group()
        if jobs:
            self._running = {j.id for j in jobs}
            try:
                self.run_group(jobs)
            except EngineDead:
                self._engine_died(jobs)
            finally:
                self._running = set()
                self._stream_len.clear()
                self._last_token_at.clear()
        return len(jobs)

    def kv_budget(self) -> int | None:
        """The engine's free KV capacity in tokens when it reports one (`VLLMEngine.free_kv_tokens`),
        else None."""
        report = getattr(self.engine, "free_kv_tokens", None)
        if not callable(report):
            return None
        try:
            free = report()
        except Exception:  # a capacity report must never stop the worker: claim by count
            log.warning("the engine's KV capacity report failed", exc_info=True)
            return None
        return None if free is None else max(0, int(free))

    def claim_group(self) -> list[Job]:
        """Claim the next length-sorted group: at most max_batch jobs and, when the engine reports
        its free KV capacity, at most that many KV tokens (`queue.base.kv_need` per job; a single
        job larger than that is still claimed)."""
        return self.queue.claim(self.worker_id, self.max_batch, self.max_wait, max_tokens=self.kv_budget())

    # -- one group -------------------------------------------------------------------------
    def _publish(self, job_id: str, events: list[dict[str, Any]]) -> bool:
        """Publish with the stream's expected length, so a retry after a lost reply adds nothing twice."""
        after = self._stream_len.get(job_id)
        ok = self._q(self.queue.publish, self.worker_id, job_id, events, after)
        if ok and after is not None:
            self._stream_len[job_id] = after + len(events)
        return ok

    def _error(self, job: Job, status: int, code: str, message: str) -> None:
        self._publish(job.id, [{"t": "error", "status": status, "code": code, "message": message}])
        self._q(self.queue.finish, self.worker_id, job.id, "failed")
        self._log_request(job, finish_reason="error", status=status, code=code)

    def _log_request(self, job: Job, finish_reason: str, prompt_tokens: int | None = None,
                     generated_tokens: int = 0, first_token_at: float | None = None,
                     telemetry: dict[str, Any] | None = None, **more: Any) -> None:
        tele = telemetry or {}
        fields: dict[str, Any] = {
            "request_id": job.id, "x_request_id": job.client_request_id, "policy": job.policy,
            "prompt_tokens": len(job.prompt_ids) if prompt_tokens is None else prompt_tokens,
            "generated_tokens": generated_tokens,
            "ttft_s": None if first_token_at is None else round(max(0.0, first_token_at - job.created), 4),
            "queue_wait_s": round(max(0.0, (job.claimed_at or job.created) - job.created), 4),
            "decode_tok_s": tele.get("decode_tok_s"), "finish_reason": finish_reason,
            "attempt": job.attempts, "worker": self.worker_id, **more,
        }
        request_log.info(" ".join(f"{k}={v}" for k, v in fields.items() if v is not None), extra=fields)
        self.requests_finished += 1
        self.metrics.finished(finish_reason, job.policy, fields["prompt_tokens"], generated_tokens,
                              fields["ttft_s"], fields["queue_wait_s"], tele)

    def run_group(self, jobs: list[Job]) -> None:
        by_key: dict[str, list[Job]] = {}
        for j in jobs:
            by_key.setdefault(j.key, []).append(j)
        for group in by_key.values():
            self._run_guarded(group)
            self.jobs_done += len(group)

    def _run_guarded(self, group: list[Job], alone: bool = False) -> None:
        """Run one policy group; a failure fails only the request that causes it: a policy that
        cannot run (every job of the group shares its options) is a 400 for each, any other error
        runs the group's requests again one by one (each resumes after what it already streamed),
        so only the one that fails alone gets the 500. Messages name no server path."""
        try:
            self._run_same_policy(group, resume_all=alone)
        except QueueUnavailable:
            raise  # the queue is gone: the jobs stay claimed and their leases bring them back
        except CotserveError as exc:
            status, code = (400, "invalid_policy") if isinstance(exc, PolicyError) else (400, "invalid_request_error")
            if isinstance(exc, RequestError) and exc.code:
                code = exc.code
            log.warning("requests %s refused: %s", [j.id for j in group], exc)
            for j in group:
                self._error(j, status, code, redact_paths(str(exc)))
        except Exception as exc:  # never let one bad batch kill the worker
            if self.engine_is_dead(exc):
                raise EngineDead(f"the engine died: {type(exc).__name__}") from exc
            if len(group) > 1 and not alone:
                log.exception("a batch of %d failed; running its requests one by one", len(group))
                for j in group:
                    self._run_guarded([j], alone=True)
                return
            log.exception("request %s failed", group[0].id)
            for j in group:
                self._error(j, 500, "server_error",
                            f"the worker failed on this request ({type(exc).__name__}); the server log has the details")

    def _vllm_stats(self) -> dict[str, float] | None:
        kv = getattr(self.engine, "kv", None)  # read at each scrape: a restart replaces the engine
        return kv.vllm_stats() if kv is not None and hasattr(kv, "vllm_stats") else None

    # -- engine death --------------------------------------------------------------------
    def engine_is_dead(self, exc: BaseException | None = None) -> bool:
        """Whether the engine can serve nothing more (vLLM's engine process died), as opposed to one
        request or batch failing."""
        if isinstance(exc, EngineDead):
            return True
        try:
            return bool(getattr(self.engine, "dead", False))
        except Exception:
            return True

    def _engine_died(self, jobs: list[Job]) -> None:
        """The engine died with `jobs` claimed. This worker stops heart-beating at once (readiness
        no longer counts it); each job goes back to the queue when another worker is alive to
        resume its stream (and it has not already been on a dying engine), else it ends with a
        503 error event; then the engine is restarted (`restart`, bounded tries with backoff).
        Raises EngineDead when it cannot be, so the process exits non-zero for its supervisor."""
        self._paused = True
        self.metrics.engine_failures.inc()
        try:
            others = [w for w in self.queue.live_workers() if w != self.worker_id]
        except Exception:  # the queue is unreachable too: its leases bring the jobs back later
            others = []
        handed = 0
        for job in jobs:
            if others and job.attempts < MAX_ENGINE_ATTEMPTS:
                handed += 1
                continue
            try:
                self._error(job, 503, "engine_failed", "the engine serving this request stopped; the server is "
                            "restarting it: retry the request")
            except Exception:
                log.warning("could not fail request %s", job.id, exc_info=True)
        log.error("the engine died with %d request(s) running: %d handed to other workers, %d failed", len(jobs),
                  handed, len(jobs) - handed)
        try:
            self.queue.leave(self.worker_id)  # requeues what is still claimed; the heartbeat goes
        except Exception:
            log.warning("could not hand back the jobs (their leases expire instead)", exc_info=True)
        self._running = set()
        self._stream_len.clear()
        self._last_token_at.clear()
        self._close_engine()
        if self.restart is None:
            raise EngineDead("the engine died")
        for attempt in range(1, self.restarts + 1):
            delay = self.restart_backoff_s * 2 ** (attempt - 1)
            log.warning("restarting the engine in %.1f s (try %d of %d)", delay, attempt, self.restarts)
            if self.stop_event.wait(delay):
                return
            try:
                self.engine = self.restart()
            except Exception as exc:
                log.error("engine restart %d of %d failed: %s", attempt, self.restarts, redact_paths(str(exc)))
                continue
            self.engine_restarts += 1
            self._engine_restarted()
            self._paused = False
            self._q(self.queue.heartbeat, self.worker_id, self.lease_s)
            log.warning("engine restarted; worker %s serving again", self.worker_id)
            return
        raise EngineDead(f"the engine died and {self.restarts} restarts failed")

    def _close_engine(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:
            log.warning("closing the dead engine failed", exc_info=True)

    def _engine_restarted(self) -> None:
        """Hook: the engine was replaced (the continuous worker opens a new pool on it)."""

    def close(self) -> None:
        """Stop serving and close the engine (its processes end)."""
        self.stop()
        self._close_engine()

    def _intake(self, job: Job, n: int, resume_all: bool = False) -> tuple[bool, Resume | None]:
        """The checks a claimed job passes before it runs, for both schedulers: its queue deadline
        (first attempt only), then, for a retried job, what an earlier worker already published.
        Returns (run it?, where its stream resumes); a job that does not run has been answered."""
        if job.deadline is not None and job.attempts == 1 and not resume_all and time.time() > job.deadline:
            self._error(job, 503, "queue_timeout",
                        f"the request waited {time.time() - job.created:.1f} s in the queue, longer than the "
                        "server's --queue-timeout; retry later")
            return False, None
        self._stream_len[job.id] = 0
        if job.attempts == 1 and not resume_all:
            return True, None
        published = self._q(self.queue.published, job.id)
        self._stream_len[job.id] = len(published)
        st, ended = published_state(published, n)
        if ended:  # the earlier worker finished it but died before acknowledging
            self._q(self.queue.finish, self.worker_id, job.id)
            self._stream_len.pop(job.id, None)
            return False, None
        if st.ids and (not job.reproducible or n > 1):
            self._error(job, 500, "worker_lost",
                        "the worker running this request stopped after streaming part of it, and its "
                        "unseeded sampling cannot be reproduced; retry the request")
            return False, None
        return True, st

    def _copies(self, job: Job, n: int, sampling: dict[str, Any]) -> list[GenRequest]:
        """The job's n sequences of one prompt: seeds seed, seed+1, ... (distinct samples); request
        ids `job` (n = 1) or `job/i`. Under benchmark replay each follows its own part of the text."""
        copies = []
        for i in range(n):
            params = SamplingParams(**sampling)
            if i and params.seed is not None:
                params.seed = (params.seed + i) % (1 << 64)
            rid = job.id if n == 1 else f"{job.id}/{i}"
            forced = self.replay.tokens(rid, params.max_tokens) if self.replay is not None else None
            copies.append(GenRequest(list(job.prompt_ids), params, request_id=rid, forced_ids=forced,
                                     priority=job.priority))
        return copies

    def _run_same_policy(self, jobs: list[Job], resume_all: bool = False) -> None:
        reqs: list[GenRequest] = []
        resume: dict[str, Resume] = {}
        live: dict[str, Job] = {}
        seq: dict[str, tuple[str, int, int]] = {}  # request id -> (job id, sequence index, n)
        left: dict[str, int] = {}  # job id -> sequences still running
        for job in jobs:
            sampling = dict(job.sampling)
            n = int(sampling.pop("n", 1) or 1)
            go, st = self._intake(job, n, resume_all)
            if not go:
                continue
            if st is not None:
                resume[job.id] = st
            try:
                copies = self._copies(job, n, sampling)
                for i, r in enumerate(copies):
                    seq[r.request_id] = (job.id, i, n)
                self.engine.check_request(copies[0])
            except RequestError as exc:
                code = exc.code or "invalid_request_error"
                self._error(job, 400, code, str(exc))
                continue
            reqs.extend(copies)
            left[job.id] = n
            for r in copies:
                live[r.request_id] = job
        if not reqs:
            return
        first = reqs[0]
        job0 = live[first.request_id]
        try:
            stack = build_policy(job0.policy, job0.options)
            check = getattr(self.engine, "check_policy", None)  # an engine that runs only some policies
            if check is not None:
                check(stack)
        except CotserveError as exc:
            for j in {j.id: j for j in live.values()}.values():
                self._error(j, 400, "invalid_policy", redact_paths(str(exc)))
            return

        lost: set[str] = set()
        first_token_at: dict[str, float] = {}
        cancel_cache: set[str] = set()
        last_poll = [0.0]

        def is_cancelled(rid: str) -> bool:
            jid = seq[rid][0]
            now = time.monotonic()
            if now - last_poll[0] >= self.cancel_poll_s:
                last_poll[0] = now
                cancel_cache.update(self._q(self.queue.cancelled, [j for j in left if j not in cancel_cache]))
            return jid in cancel_cache or jid in lost

        for deltas in self.engine.stream(reqs, stack, None, cancelled=is_cancelled):
            for d in deltas:
                job = live[d.request_id]
                jid, index, n = seq[d.request_id]
                if jid in lost:
                    continue
                events: list[dict[str, Any]] = []
                ids, text = list(d.token_ids), d.text
                st = resume.get(d.request_id)
                if st is not None and not st.failed:
                    ids, text = self._skip_published(st, ids, text)
                    if st.failed:
                        events.append(diverged_error())
                        lost.add(jid)
                sent = 0
                if jid not in lost and (ids or text):
                    events.append(delta_event(ids, text, d.logprobs, index, n))
                    first_token_at.setdefault(jid, time.time())
                    sent = len(ids)
                if d.result is not None and jid not in lost:
                    events.append(done_event(job, d.result, index, n, self.worker_id))
                if events and not self._publish(jid, events):
                    lost.add(jid)  # reaped and handed on: stop decoding it here
                    continue
                if sent:
                    self._sent(d.request_id, sent)
                if d.result is not None:
                    self._last_token_at.pop(d.request_id, None)
                if jid in lost:
                    if left.pop(jid, None) is not None:
                        self._q(self.queue.finish, self.worker_id, jid, "failed")
                elif d.result is not None:
                    left[jid] -= 1
                    if left[jid] == 0:
                        del left[jid]
                        state = "cancelled" if d.result.finish_reason == "cancelled" else "done"
                        self._q(self.queue.finish, self.worker_id, jid, state)
                        self._log_request(job, d.result.finish_reason, d.result.prompt_tokens,
                                          d.result.completion_tokens, first_token_at.get(jid), d.result.telemetry)

    @staticmethod
    def _skip_published(st: Resume, ids: list[int], text: str) -> tuple[list[int], str]:
        """Drop the part of a regenerated delta that an earlier attempt already published,
        checking the regenerated token ids against the published ones."""
        start = st.seen_ids
        st.seen_ids += len(ids)
        overlap = st.ids[start : start + len(ids)]
        if overlap != ids[: len(overlap)]:
            st.failed = True
            return [], ""
        new_ids = ids[len(overlap):]
        tstart = st.seen_text
        st.seen_text += len(text)
        skip = max(0, min(len(text), st.text_len - tstart))
        return new_ids, text[skip:]
