"""Redis queue: jobs, a pending set ordered by prompt length, an output stream per job, worker
heartbeats (ARCHITECTURE.md). Every multi-key change is one Lua script, so it is atomic.

Keys (all under `prefix`, default "cotserve:"):
  job:{id}           hash: spec (Job JSON), state, pkey, len, need (`kv_need`), enq, worker, attempts,
                     claimed_at, cancel
  pending            sorted set: id -> rank, enqueue time + priority x PRIORITY_SPAN (finds the first
                     waiting job: the lowest priority value, then the oldest)
  pending:{pkey}     sorted set per group key (policy key and priority, `group_key`): id -> prompt
                     length (finds its length neighbours)
  out:{id}           stream: the job's events
  hb:{worker}        a key with a TTL: the worker's heartbeat
  workers            set of worker ids seen
  claimed:{worker}   set of job ids a worker holds
  leases             sorted set: claimed job id -> lease expiry (unix time); the worker renews the
                     leases of the jobs it runs (each publish, and its heartbeat thread), and a
                     job whose lease ran out returns to pending, whatever its worker's heartbeat

Connections retry with backoff on connection errors (redis-py's `Retry`) and check pooled
connections before use, so a restart of Redis costs a pause, not an error; what still fails
raises `QueueUnavailable`, which the gateway and the worker ride out for a while.

Finished jobs are acknowledged: they leave `claimed:{worker}`, and their hash and stream expire
after `result_ttl` seconds. The scripts address keys built from the prefix inside Lua, which a
single Redis (or a replicated one) runs as is; Redis Cluster is not supported.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis
import redis.asyncio as aredis

from cotserve.queue.base import Job, JobQueue, QueueFull, QueueUnavailable, group_key, kv_need, pending_rank

SUBMIT = """
local prefix, id, len, enq, maxp, spec, pkey = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7]
if redis.call('ZCARD', prefix .. 'pending') >= maxp then return 0 end
redis.call('HSET', prefix .. 'job:' .. id, 'spec', spec, 'state', 'pending', 'pkey', pkey, 'len', len,
           'need', ARGV[8], 'enq', enq, 'rank', ARGV[9], 'attempts', 0)
redis.call('ZADD', prefix .. 'pending', ARGV[9], id)
redis.call('ZADD', prefix .. 'pending:' .. pkey, len, id)
return 1
"""

# The first waiting job (by rank: priority, then age) plus up to B-1 others of its group key (policy
# key and priority) closest to it in prompt length
# (ties to the shorter one), claimed in one step. ARGV[7] is a KV token budget (-1: none): the
# group then ends at the first neighbour whose `need` no longer fits (the oldest job is always
# taken; a job without `need` counts its length). Returns {} (nothing / still filling) or
# {id1, spec1, attempts1, id2, ...}.
CLAIM = """
local prefix, B, now, maxwait, wid = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local budget = tonumber(ARGV[7])
local oldest = redis.call('ZRANGE', prefix .. 'pending', 0, 0, 'WITHSCORES')
if #oldest == 0 then return {} end
local oid = oldest[1]
local ots = tonumber(redis.call('HGET', prefix .. 'job:' .. oid, 'enq')) or tonumber(oldest[2])
local pkey = redis.call('HGET', prefix .. 'job:' .. oid, 'pkey')
if not pkey then
  redis.call('ZREM', prefix .. 'pending', oid)
  return {}
end
local lkey = prefix .. 'pending:' .. pkey
local waiting = redis.call('ZCARD', lkey)
if budget < 0 and waiting < B and (now - ots) < maxwait then return {} end
local function need(id)
  local k = prefix .. 'job:' .. id
  return tonumber(redis.call('HGET', k, 'need') or redis.call('HGET', k, 'len')) or 0
end
local used = 0
if budget >= 0 then used = need(oid) end
local len = tonumber(redis.call('ZSCORE', lkey, oid))
local rank = redis.call('ZRANK', lkey, oid)
local below = {}
if rank > 0 then below = redis.call('ZRANGE', lkey, math.max(0, rank - B + 1), rank - 1, 'WITHSCORES') end
local above = redis.call('ZRANGE', lkey, rank + 1, rank + B - 1, 'WITHSCORES')
local picked = {oid}
local bi, ai = #below - 1, 1
while #picked < B do
  local db, da = nil, nil
  if bi >= 1 then db = len - tonumber(below[bi + 1]) end
  if ai <= #above then da = tonumber(above[ai + 1]) - len end
  if db == nil and da == nil then break end
  local from_below = da == nil or (db ~= nil and db <= da)
  local take = from_below and below[bi] or above[ai]
  if budget >= 0 then
    local cost = need(take)
    if used + cost > budget then break end
    used = used + cost
  end
  table.insert(picked, take)
  if from_below then bi = bi - 2 else ai = ai + 2 end
end
if budget >= 0 and #picked == waiting and #picked < B and (now - ots) < maxwait then return {} end
local out = {}
for _, id in ipairs(picked) do
  local k = prefix .. 'job:' .. id
  redis.call('ZREM', prefix .. 'pending', id)
  redis.call('ZREM', lkey, id)
  redis.call('HSET', k, 'state', 'claimed', 'worker', wid, 'claimed_at', ARGV[3])
  local attempts = redis.call('HINCRBY', k, 'attempts', 1)
  redis.call('SADD', prefix .. 'claimed:' .. wid, id)
  redis.call('ZADD', prefix .. 'leases', now + tonumber(ARGV[6]), id)
  table.insert(out, id); table.insert(out, redis.call('HGET', k, 'spec')); table.insert(out, attempts)
end
redis.call('SADD', prefix .. 'workers', wid)
return out
"""

# Append events only while this worker still owns the job. ARGV[6] is the stream's length before
# these events (-1: unknown); when the stream already holds them (a retry of a call whose reply
# was lost), nothing is written again.
PUBLISH = """
local prefix, id, wid, ttl, after = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[6])
local k = prefix .. 'job:' .. id
if redis.call('HGET', k, 'state') ~= 'claimed' or redis.call('HGET', k, 'worker') ~= wid then return 0 end
redis.call('ZADD', prefix .. 'leases', ARGV[5], id)
if after >= 0 and redis.call('XLEN', prefix .. 'out:' .. id) >= after + #ARGV - 6 then return 1 end
for i = 7, #ARGV do redis.call('XADD', prefix .. 'out:' .. id, '*', 'e', ARGV[i]) end
redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
return 1
"""

FINISH = """
local prefix, id, wid, state, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local k = prefix .. 'job:' .. id
redis.call('SREM', prefix .. 'claimed:' .. wid, id)
redis.call('ZREM', prefix .. 'leases', id)
if redis.call('HGET', k, 'worker') == wid and redis.call('HGET', k, 'state') == 'claimed' then
  redis.call('HSET', k, 'state', state)
  redis.call('EXPIRE', k, ttl)
  redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
end
return 1
"""

CANCEL = """
local prefix, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local k = prefix .. 'job:' .. id
local state = redis.call('HGET', k, 'state')
if not state then return 0 end
redis.call('HSET', k, 'cancel', 1)
if state == 'pending' then
  redis.call('ZREM', prefix .. 'pending', id)
  redis.call('ZREM', prefix .. 'pending:' .. redis.call('HGET', k, 'pkey'), id)
  redis.call('HSET', k, 'state', 'cancelled')
  redis.call('EXPIRE', k, ttl)
  redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
end
return 1
"""

# Return the claimed jobs of a worker whose heartbeat key is gone to the pending set, at their
# original enqueue time (so they are the oldest and go first).
REAP = """
local prefix, wid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local force = ARGV[4] == '1'
if not force and redis.call('EXISTS', prefix .. 'hb:' .. wid) == 1 then return {} end
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'claimed:' .. wid)) do
  local k = prefix .. 'job:' .. id
  redis.call('ZREM', prefix .. 'leases', id)
  if redis.call('HGET', k, 'state') == 'claimed' and redis.call('HGET', k, 'worker') == wid then
    if redis.call('HGET', k, 'cancel') == '1' then
      redis.call('HSET', k, 'state', 'cancelled')
      redis.call('EXPIRE', k, ttl)
    else
      local pkey = redis.call('HGET', k, 'pkey')
      redis.call('HSET', k, 'state', 'pending', 'worker', '')
      redis.call('ZADD', prefix .. 'pending', redis.call('HGET', k, 'rank') or redis.call('HGET', k, 'enq'), id)
      redis.call('ZADD', prefix .. 'pending:' .. pkey, redis.call('HGET', k, 'len'), id)
      table.insert(out, id)
    end
  end
end
redis.call('DEL', prefix .. 'claimed:' .. wid, prefix .. 'hb:' .. wid)
redis.call('SREM', prefix .. 'workers', wid)
return out
"""

# Return the claimed jobs whose lease ran out to the pending set (their worker is gone, or no
# longer runs them), at their original enqueue time.
REAP_LEASES = """
local prefix, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', prefix .. 'leases', '-inf', now)) do
  redis.call('ZREM', prefix .. 'leases', id)
  local k = prefix .. 'job:' .. id
  if redis.call('HGET', k, 'state') == 'claimed' then
    local wid = redis.call('HGET', k, 'worker')
    redis.call('SREM', prefix .. 'claimed:' .. wid, id)
    if redis.call('HGET', k, 'cancel') == '1' then
      redis.call('HSET', k, 'state', 'cancelled')
      redis.call('EXPIRE', k, ttl)
    else
      redis.call('HSET', k, 'state', 'pending', 'worker', '')
      redis.call('ZADD', prefix .. 'pending', redis.call('HGET', k, 'rank') or redis.call('HGET', k, 'enq'), id)
      redis.call('ZADD', prefix .. 'pending:' .. redis.call('HGET', k, 'pkey'), redis.call('HGET', k, 'len'), id)
      table.insert(out, id)
    end
  end
end
return out
"""

RETRY_ERRORS = [redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError]


def _sync_errors(fn):
    """Worker-side calls raise QueueUnavailable when Redis stays unreachable through the retries."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise QueueUnavailable(f"redis: {exc}") from exc

    return wrapped


class RedisQueue(JobQueue):
    def __init__(self, url: str, prefix: str = "cotserve:", result_ttl: int = 300, lease_s: float = 5.0,
                 retries: int = 6):
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self.url = url
        self.prefix = prefix
        self.result_ttl = int(result_ttl)
        self.lease_s = float(lease_s)  # a claim's lease; the worker's renewals extend it
        self.retries = int(retries)
        self.r = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=30, socket_connect_timeout=2, health_check_interval=2,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), self.retries), retry_on_error=RETRY_ERRORS)
        self._scripts = {name: self.r.register_script(src) for name, src in
                         {"submit": SUBMIT, "claim": CLAIM, "publish": PUBLISH, "finish": FINISH,
                          "cancel": CANCEL, "reap": REAP, "reap_leases": REAP_LEASES}.items()}
        self._ar: aredis.Redis | None = None
        self._ar_loop: asyncio.AbstractEventLoop | None = None
        self._ascripts: dict[str, Any] = {}

    def _a(self) -> aredis.Redis:
        """The async client, bound to the running event loop (made again if the loop changed)."""
        loop = asyncio.get_running_loop()
        if self._ar is None or self._ar_loop is not loop:
            from redis.asyncio.retry import Retry as ARetry
            from redis.backoff import ExponentialBackoff

            self._ar = aredis.Redis.from_url(
                self.url, decode_responses=True, socket_connect_timeout=2, health_check_interval=2,
                retry=ARetry(ExponentialBackoff(cap=0.5, base=0.05), self.retries), retry_on_error=RETRY_ERRORS)
            self._ar_loop = loop
            self._ascripts = {"submit": self._ar.register_script(SUBMIT), "cancel": self._ar.register_script(CANCEL)}
        return self._ar

    def k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- gateway side ----------------------------------------------------------------------
    async def submit(self, job: Job, max_pending: int) -> None:
        self._a()
        try:
            ok = await self._ascripts["submit"](args=[self.prefix, job.id, job.prompt_len, job.created,
                                                       max_pending, job.to_json(), group_key(job), kv_need(job),
                                                       pending_rank(job)])
        except (redis.RedisError, OSError) as exc:
            raise QueueUnavailable(f"redis: {exc}") from exc
        if not ok:
            raise QueueFull(retry_after=1.0)

    async def read(self, job_id: str, after: str, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        ar = self._a()
        try:
            res = await ar.xread({self.k("out", job_id): after}, block=max(1, int(timeout * 1000)), count=512)
        except (redis.RedisError, OSError) as exc:
            raise QueueUnavailable(f"redis: {exc}") from exc
        out = []
        for _stream, entries in res or []:
            for eid, fields in entries:
                out.append((eid, json.loads(fields["e"])))
        return out

    async def cancel(self, job_id: str) -> None:
        self._a()
        try:
            await self._ascripts["cancel"](args=[self.prefix, job_id, self.result_ttl])
        except redis.RedisError:
            pass  # nothing to cancel when Redis is gone; the job expires with it

    async def state(self, job_id: str) -> str | None:
        try:
            return await self._a().hget(self.k("job", job_id), "state")
        except (redis.RedisError, OSError) as exc:
            raise QueueUnavailable(f"redis: {exc}") from exc

    async def stats(self) -> dict[str, int]:
        """Pending jobs, jobs running under a live lease, workers with a live heartbeat."""
        ar = self._a()
        workers = await ar.smembers(self.k("workers"))
        live = 0
        for w in workers:
            if await ar.exists(self.k("hb", w)):
                live += 1
        running = await ar.zcount(self.k("leases"), time.time(), "+inf")
        return {"pending": await ar.zcard(self.k("pending")), "running": running, "workers": live}

    async def ping(self) -> bool:
        try:
            return bool(await self._a().ping())
        except (redis.RedisError, OSError):
            return False

    async def aclose(self) -> None:
        if self._ar is not None:
            await self._ar.aclose()
            self._ar = None

    # -- worker side -----------------------------------------------------------------------
    @_sync_errors
    def claim(self, worker_id: str, max_batch: int, max_wait: float, max_tokens: int | None = None) -> list[Job]:
        now = time.time()
        budget = -1 if max_tokens is None else max(0, int(max_tokens))
        res = self._scripts["claim"](args=[self.prefix, max_batch, now, max_wait, worker_id, self.lease_s, budget])
        return [Job.from_json(res[i + 1], int(res[i + 2]), now) for i in range(0, len(res), 3)]

    @_sync_errors
    def publish(self, worker_id: str, job_id: str, events: list[dict[str, Any]], after: int | None = None) -> bool:
        payload = [json.dumps(e, separators=(",", ":")) for e in events]
        return bool(self._scripts["publish"](args=[self.prefix, job_id, worker_id, self.result_ttl,
                                                    time.time() + self.lease_s, -1 if after is None else after,
                                                    *payload]))

    @_sync_errors
    def renew(self, worker_id: str, job_ids: list[str], ttl: float) -> None:
        if job_ids:
            until = time.time() + ttl
            self.r.zadd(self.k("leases"), dict.fromkeys(job_ids, until), xx=True)

    @_sync_errors
    def published(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(f["e"]) for _id, f in self.r.xrange(self.k("out", job_id))]

    @_sync_errors
    def finish(self, worker_id: str, job_id: str, state: str = "done") -> None:
        self._scripts["finish"](args=[self.prefix, job_id, worker_id, state, self.result_ttl])

    @_sync_errors
    def cancelled(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hget(self.k("job", j), "cancel")
        return {j for j, v in zip(job_ids, pipe.execute(), strict=True) if v == "1"}

    @_sync_errors
    def heartbeat(self, worker_id: str, ttl: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.k("hb", worker_id), str(time.time()), px=max(1, int(ttl * 1000)))
        pipe.sadd(self.k("workers"), worker_id)
        pipe.execute()

    @_sync_errors
    def reap(self) -> list[str]:
        out: list[str] = []
        for w in self.r.smembers(self.k("workers")):
            out.extend(self._scripts["reap"](args=[self.prefix, w, self.result_ttl, "0"]))
        out.extend(self._scripts["reap_leases"](args=[self.prefix, time.time(), self.result_ttl]))
        return out

    @_sync_errors
    def live_workers(self) -> list[str]:
        workers = sorted(self.r.smembers(self.k("workers")))
        pipe = self.r.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self.k("hb", w))
        return [w for w, alive in zip(workers, pipe.execute(), strict=True) if alive]

    @_sync_errors
    def leave(self, worker_id: str) -> None:
        self._scripts["reap"](args=[self.prefix, worker_id, self.result_ttl, "1"])

    def close(self) -> None:
        self.r.close()

    def drop_all(self) -> int:
        """Delete every key under the prefix (tests and `--reset`)."""
        n = 0
        for key in self.r.scan_iter(match=self.prefix + "*", count=500):
            n += self.r.delete(key)
        return n
