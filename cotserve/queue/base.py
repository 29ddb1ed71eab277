"""The job queue between the gateway and the workers (ARCHITECTURE.md, "Queue and workers").

A job is one chat completion: prompt token ids, sampling settings, the policy spec with its
options, and timestamps. The gateway `submit`s jobs and reads each job's output stream; workers
`claim` GROUPS of jobs (the oldest waiting job plus up to B-1 others of the same policy key that are
closest to it in prompt length, SkipKV Sec. 4.3's length-sorted grouping; optionally also bounded by
a KV token budget, each job counting `kv_need(job)`), `publish` events,
and `finish` (acknowledge) them. A worker heart-beats; `reap` returns the jobs of a worker whose
heartbeat stopped to the pending set, where another worker picks them up.

Two implementations share this interface: `RedisQueue` (multi-process) and `InProcessQueue`
(the embedded default). Worker-side methods are synchronous (the worker is a plain loop around
the engine); gateway-side methods are async (the gateway is an asyncio server).

Events on a job's stream are small dicts:
  {"t": "delta", "ids": [...], "text": "..."}      new tokens and the text that is safe to show
  {"t": "done", "finish_reason": ..., "usage": {...}, "telemetry": {...}}
  {"t": "error", "status": int, "code": ..., "message": ...}
"""

from __future__ import annotations

import abc
import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cotserve.grouping import closest_in_length


class QueueFull(Exception):
    """The pending set is at its limit; the client should retry later."""

    def __init__(self, retry_after: float = 1.0):
        super().__init__("the queue is full")
        self.retry_after = retry_after


class QueueUnavailable(Exception):
    """The queue backend (Redis) cannot be reached."""


def policy_key(policy: str, options: dict[str, Any]) -> str:
    """Jobs batch together only when their policy spec and options are identical."""
    return json.dumps([policy, options], sort_keys=True, separators=(",", ":"))


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    policy: str = "dense"
    options: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    deadline: float | None = None  # unix time after which a job not yet started is dropped (503)
    client_request_id: str | None = None  # the client's X-Request-Id (in both sides' log lines)
    priority: int = 0  # lower is claimed earlier (vLLM's convention); equal priorities in arrival order
    attempts: int = 0  # set by the queue at claim time (1 = first run)
    claimed_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def key(self) -> str:
        return policy_key(self.policy, self.options)

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded: a re-run gives the same tokens, so a retry can resume a stream."""
        return float(self.sampling.get("temperature", 0.0)) <= 0 or self.sampling.get("seed") is not None

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("attempts")
        d.pop("claimed_at")
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, attempts: int = 0, claimed_at: float = 0.0) -> Job:
        """A job from its JSON; fields this version does not know (a newer gateway's) are left out."""
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}, attempts=attempts, claimed_at=claimed_at)


# priorities a request may give (`Job.priority`): the Redis queue orders its pending jobs by
# enqueue time + priority x PRIORITY_SPAN seconds (115 days), which keeps arrival order within a
# priority to about 20 microseconds at the limit (a double's resolution there)
PRIORITY_LIMIT = 10_000
PRIORITY_SPAN = 1e7


def pending_rank(job: Job) -> float:
    """A pending job's place in the claim order (smaller first): its priority, then its arrival."""
    return job.created + job.priority * PRIORITY_SPAN


def group_key(job: Job) -> str:
    """What a claimed group shares: the policy key and the priority (a group never takes a job of
    another priority along with its first one). Priority 0 keeps the bare policy key."""
    return job.key if not job.priority else f"{job.key}|p{job.priority}"


# SamplingParams.max_tokens's default (cotserve.engine.sampling, which needs torch): the length a
# job without `max_tokens` in its sampling settings may generate. A test keeps the two equal.
DEFAULT_MAX_TOKENS = 256

# Eviction policies whose KV stays within budget + interval entries after admission, with those
# options' defaults (`cotserve.policies.options`; the queue sits below the policies, so they are
# repeated here and a test keeps them equal).
EVICTION_DEFAULTS: dict[str, tuple[int, int]] = {
    "skipkv": (1024, 128), "rkv": (1024, 128), "streamingllm": (1024, 1), "h2o": (1024, 1)}


def _int_option(options: dict[str, Any], policy: str, name: str, default: int) -> int | None:
    """`policy.name`, else `name`, else the default (a part-qualified option wins, as in routing)."""
    value = options.get(f"{policy}.{name}", options.get(name, default))
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def kv_need(job: Job) -> int:
    """The KV tokens a job may hold at its peak, the cost a token-bounded claim counts:
    n * (prompt_len + decode), where decode is the job's `max_tokens` (DEFAULT_MAX_TOKENS when
    unset) and n its sequences (`n`, one cache each). Under an eviction policy with a `budget`
    and an `interval` (skipkv, rkv, streamingllm, h2o) a sequence keeps about prompt_len entries
    at admission and at most budget + interval afterwards, so decode is capped at budget +
    interval. An estimate, not vLLM's block accounting (blocks round each sequence up)."""
    s = job.sampling
    max_tokens = s.get("max_tokens")
    decode = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else DEFAULT_MAX_TOKENS
    for part in (p.strip() for p in (job.policy or "").split("+")):
        if part in EVICTION_DEFAULTS:
            budget, interval = EVICTION_DEFAULTS[part]
            b, i = _int_option(job.options, part, "budget", budget), _int_option(job.options, part, "interval", interval)
            if b is not None and i is not None and b > 0 and i > 0:
                decode = min(decode, b + i)
    n = s.get("n")
    copies = n if isinstance(n, int) and n > 1 else 1
    return copies * (job.prompt_len + decode)


def pick_group(oldest: tuple[str, int], others: list[tuple[str, int]], max_batch: int,
               max_tokens: int | None = None, need: dict[str, int] | None = None) -> list[str]:
    """The oldest job plus up to max_batch-1 of `others` closest to it in prompt length
    (ties go to the shorter one; `cotserve.grouping.closest_in_length`). `others` are (id, length)
    pairs of the same policy key. With `max_tokens` (and `need`: id -> `kv_need`), the group ends
    at the first neighbour whose need no longer fits the budget; the oldest job is always taken.
    Plain-Python twin of the Redis claim script, used by the in-process queue and the tests."""
    return closest_in_length(oldest, others, max_batch, max_tokens, need.__getitem__ if need else None)


class JobQueue(abc.ABC):
    """Interface shared by the Redis and the in-process queue."""

    # -- gateway side (async) ------------------------------------------------------------
    @abc.abstractmethod
    async def submit(self, job: Job, max_pending: int) -> None:
        """Add a job to the pending set, or raise QueueFull when it holds max_pending jobs."""

    @abc.abstractmethod
    async def read(self, job_id: str, after: str, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """Events of a job's stream after event id `after` ("0" = from the start); waits up to
        `timeout` seconds for at least one."""

    @abc.abstractmethod
    async def cancel(self, job_id: str) -> None:
        """A pending job is dropped; a running one is flagged (its worker stops it)."""

    @abc.abstractmethod
    async def state(self, job_id: str) -> str | None:
        """The job's state (pending, claimed, done, failed, cancelled), or None when the queue has
        no such job."""

    @abc.abstractmethod
    async def stats(self) -> dict[str, int]:
        """{"pending", "running", "workers"} (workers with a live heartbeat)."""

    @abc.abstractmethod
    async def ping(self) -> bool:
        """Whether the backend answers."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release async connections (optional)."""

    # -- worker side (sync) --------------------------------------------------------------
    @abc.abstractmethod
    def claim(self, worker_id: str, max_batch: int, max_wait: float, max_tokens: int | None = None) -> list[Job]:
        """Atomically claim a group (see `pick_group`). Returns [] when nothing is pending, or
        while the group could still grow (it took every waiting job of the oldest job's policy
        key, fewer than max_batch, and none was left out for the budget) and the oldest has
        waited less than max_wait seconds. `max_tokens`: the group's summed `kv_need` stays
        within it (None: no token bound); the oldest job is claimed even when it alone exceeds it."""

    @abc.abstractmethod
    def publish(self, worker_id: str, job_id: str, events: list[dict[str, Any]], after: int | None = None) -> bool:
        """Append events to a job's stream; False when this worker no longer owns the job
        (it was reaped and handed to another worker), in which case nothing is written.
        `after`: how many events the stream holds before these, when the caller knows; a call
        repeated with the same `after` (a retry whose first reply was lost) writes nothing again."""

    @abc.abstractmethod
    def published(self, job_id: str) -> list[dict[str, Any]]:
        """Every event on a job's stream so far (a retry resumes from these)."""

    @abc.abstractmethod
    def finish(self, worker_id: str, job_id: str, state: str = "done") -> None:
        """Acknowledge a job: it leaves the worker's claimed set; job and stream expire."""

    @abc.abstractmethod
    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Which of these jobs a client has cancelled."""

    @abc.abstractmethod
    def heartbeat(self, worker_id: str, ttl: float) -> None:
        """The worker is alive for the next `ttl` seconds."""

    @abc.abstractmethod
    def reap(self) -> list[str]:
        """Return the claimed jobs of workers whose heartbeat expired to the pending set."""

    def renew(self, worker_id: str, job_ids: list[str], ttl: float) -> None:  # noqa: B027 - optional
        """Extend the leases of jobs this worker runs by `ttl` seconds (queues with leases)."""

    def live_workers(self) -> list[str]:
        """Ids of the workers whose heartbeat is current (a dying worker hands its jobs to these)."""
        return []

    @abc.abstractmethod
    def leave(self, worker_id: str) -> None:
        """A worker stops cleanly: its heartbeat goes, its unfinished jobs return to pending."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (optional)."""
