"""The job queue, Redis and in-process, against the same expectations (no model needed).

The Redis claim script is checked against its plain-Python twin `pick_group` on random inputs."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from cotserve.queue import InProcessQueue, Job, QueueFull, pick_group
from cotserve.queue.redis_queue import RedisQueue

REDIS_URL = "redis://127.0.0.1:6379/5"


@pytest.fixture(params=["memory", "redis"])
def queue(request):
    if request.param == "memory":
        yield InProcessQueue()
        return
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    q = RedisQueue(REDIS_URL, prefix=f"cotserve-test-{uuid.uuid4().hex[:8]}:", result_ttl=60)
    yield q
    q.drop_all()
    q.close()


def run(coro):
    return asyncio.run(coro)


def submit(q, job, max_pending=1000):
    run(q.submit(job, max_pending))
    return job


def test_pick_group_closest_lengths():
    others = [("a", 5), ("b", 12), ("c", 9), ("d", 30), ("e", 11)]
    assert pick_group(("o", 10), others, 3) == ["o", "c", "e"]  # |9-10| = |11-10|: shorter first
    assert pick_group(("o", 10), others, 1) == ["o"]
    assert pick_group(("o", 10), [], 4) == ["o"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_matches_pick_group(queue, seed):
    rng = random.Random(seed)
    lengths = rng.sample(range(1, 200), 24)  # distinct: no ties, so the order is unique
    jobs = []
    t0 = time.time() - 100
    for i, n in enumerate(lengths):
        jobs.append(submit(queue, Job(prompt_ids=[1] * n, created=t0 + i)))
    remaining = {j.id: j for j in jobs}
    while remaining:
        b = rng.randint(1, 6)
        oldest = min(remaining.values(), key=lambda j: j.created)
        others = [(j.id, j.prompt_len) for j in remaining.values() if j.id != oldest.id]
        want = pick_group((oldest.id, oldest.prompt_len), others, b)
        got = queue.claim("w1", b, 0.0)
        assert [j.id for j in got] == want
        assert all(j.attempts == 1 for j in got)
        for j in got:
            del remaining[j.id]
    assert queue.claim("w1", 4, 0.0) == []


def test_groups_never_mix_policies(queue):
    a = [submit(queue, Job(prompt_ids=[1] * (5 + i), policy="dense", options={})) for i in range(3)]
    b = [submit(queue, Job(prompt_ids=[1] * (5 + i), policy="dense", options={"x": 1})) for i in range(3)]
    first = queue.claim("w", 8, 0.0)
    second = queue.claim("w", 8, 0.0)
    assert {j.id for j in first} == {j.id for j in a}
    assert {j.id for j in second} == {j.id for j in b}


def test_max_wait_lets_a_group_fill(queue):
    submit(queue, Job(prompt_ids=[1, 2, 3]))
    assert queue.claim("w", 4, max_wait=3600.0) == []  # fewer than B waiting, oldest is fresh
    got = queue.claim("w", 4, max_wait=0.0)
    assert len(got) == 1


def test_queue_full(queue):
    submit(queue, Job(prompt_ids=[1]), max_pending=2)
    submit(queue, Job(prompt_ids=[1]), max_pending=2)
    with pytest.raises(QueueFull):
        submit(queue, Job(prompt_ids=[1]), max_pending=2)
    queue.claim("w", 1, 0.0)  # running jobs do not count against the limit
    submit(queue, Job(prompt_ids=[1]), max_pending=2)


def test_events_reach_the_reader_in_order(queue):
    job = submit(queue, Job(prompt_ids=[1, 2]))
    (claimed,) = queue.claim("w", 1, 0.0)

    async def scenario():
        reader = asyncio.create_task(queue.read(job.id, "0", 5.0))
        await asyncio.sleep(0.05)
        assert queue.publish("w", job.id, [{"t": "delta", "ids": [7], "text": "a"}])
        first = await reader
        assert queue.publish("w", job.id, [{"t": "delta", "ids": [8], "text": "b"}, {"t": "done"}])
        rest = await queue.read(job.id, first[-1][0], 1.0)
        return [e for _, e in first + rest]

    events = run(scenario())
    assert [e.get("text") for e in events] == ["a", "b", None]
    assert queue.published(job.id) == events
    queue.finish("w", job.id)
    assert not queue.publish("w", job.id, [{"t": "delta"}])  # acknowledged: nothing more lands


def test_cancel_pending_and_running(queue):
    pending = submit(queue, Job(prompt_ids=[1] * 3, created=time.time() + 10))
    running = submit(queue, Job(prompt_ids=[1] * 50, created=time.time()))
    (got,) = queue.claim("w", 1, 0.0)
    assert got.id == running.id
    run(queue.cancel(pending.id))
    run(queue.cancel(running.id))
    assert queue.claim("w", 4, 0.0) == []  # the pending one is gone
    assert queue.cancelled([pending.id, running.id]) == {pending.id, running.id}
    assert run(queue.stats())["pending"] == 0


def test_dead_worker_jobs_return_and_old_owner_is_fenced(queue):
    job = submit(queue, Job(prompt_ids=[1, 2, 3]))
    queue.heartbeat("dead", ttl=0.2)
    queue.heartbeat("alive", ttl=60)
    (c,) = queue.claim("dead", 1, 0.0)
    assert queue.publish("dead", job.id, [{"t": "delta", "ids": [5], "text": "x"}])
    assert queue.reap() == []  # still heart-beating
    time.sleep(0.4)  # let the heartbeat expire (a TTL, not a speed assertion)
    assert queue.reap() == [job.id]
    (again,) = queue.claim("alive", 1, 0.0)
    assert again.id == job.id and again.attempts == 2
    assert not queue.publish("dead", job.id, [{"t": "delta", "ids": [6], "text": "y"}])
    assert queue.publish("alive", job.id, [{"t": "delta", "ids": [6], "text": "y"}])
    assert [e["text"] for e in queue.published(job.id)] == ["x", "y"]
    assert run(queue.stats())["workers"] == 1


def test_leave_hands_jobs_back(queue):
    job = submit(queue, Job(prompt_ids=[1]))
    queue.heartbeat("w", ttl=60)
    queue.claim("w", 1, 0.0)
    queue.leave("w")
    (again,) = queue.claim("w2", 1, 0.0)
    assert again.id == job.id


def test_finished_jobs_expire_in_redis():
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    q = RedisQueue(REDIS_URL, prefix=f"cotserve-test-{uuid.uuid4().hex[:8]}:", result_ttl=30)
    try:
        job = submit(q, Job(prompt_ids=[1]))
        q.claim("w", 1, 0.0)
        q.publish("w", job.id, [{"t": "done"}])
        q.finish("w", job.id)
        assert 0 < q.r.ttl(q.k("job", job.id)) <= 30
        assert 0 < q.r.ttl(q.k("out", job.id)) <= 30
        assert q.r.hget(q.k("job", job.id), "state") == "done"
        assert q.r.scard(q.k("claimed", "w")) == 0
    finally:
        q.drop_all()


def test_bench_percentile_matches_numpy():
    import numpy as np

    from cotserve.bench.serve import percentile

    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = [rng.random() * 10 for _ in range(n)]
        for q in (50, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_publish_repeated_after_a_lost_reply_writes_nothing_twice(queue):
    """A retry of a publish whose reply was lost (the script ran, the answer did not come back) is
    the same call again, made here directly: with the stream's expected length the second call
    adds nothing; an unknown length (None) appends as before."""
    job = submit(queue, Job(prompt_ids=[1, 2, 3]))
    (claimed,) = queue.claim("w", 1, 0.0)
    a, b, c = ({"t": "delta", "ids": [i], "text": str(i)} for i in range(3))
    assert queue.publish("w", claimed.id, [a, b], 0) and queue.publish("w", claimed.id, [a, b], 0)
    assert queue.published(job.id) == [a, b]
    assert queue.publish("w", claimed.id, [c], 2) and queue.publish("w", claimed.id, [c], 2)
    assert queue.published(job.id) == [a, b, c]
    assert queue.publish("w", claimed.id, [c])
    assert queue.published(job.id) == [a, b, c, c]
    assert not queue.publish("other", claimed.id, [a], 4)  # not the owner: refused, nothing written
    assert len(queue.published(job.id)) == 4


# -- claims bounded by a KV token budget (each job counts `kv_need`: prompt_len + max_tokens here) --
def _sized(n: int, created: float, max_tokens: int = 10, **kw) -> Job:
    return Job(prompt_ids=[1] * n, sampling={"max_tokens": max_tokens}, created=created, **kw)


def test_pick_group_with_a_token_budget_stops_at_the_first_neighbour_that_does_not_fit():
    others = [("a", 5), ("b", 12), ("c", 9), ("d", 30), ("e", 11)]
    need = {"o": 20, "a": 15, "b": 22, "c": 19, "d": 40, "e": 21}
    assert pick_group(("o", 10), others, 6, 60, need) == ["o", "c", "e"]  # 20 + 19 + 21; b (22) is over
    assert pick_group(("o", 10), others, 2, 1000, need) == ["o", "c"]  # the count still caps it
    assert pick_group(("o", 10), others, 6, 5, need) == ["o"]  # the oldest alone, even over the budget
    assert pick_group(("o", 10), others, 6, None, need) == pick_group(("o", 10), others, 6)


def test_claim_with_a_token_budget_takes_neighbours_in_length_order(queue):
    t0 = time.time() - 100
    oldest = submit(queue, _sized(50, t0))  # need 60
    near = [submit(queue, _sized(n, t0 + 1 + i)) for i, n in enumerate((48, 53, 40, 70))]  # 58, 63, 50, 80
    got = queue.claim("w1", 8, 0.0, max_tokens=190)  # 60 + 58 + 63 = 181; the next (40: 50) is over
    assert [j.id for j in got] == [oldest.id, near[0].id, near[1].id]
    assert sum(j.prompt_len + j.sampling["max_tokens"] for j in got) <= 190
    # the rest: oldest now 40 (need 50), then 70 (80); the count caps at 1
    assert [j.id for j in queue.claim("w1", 1, 0.0, max_tokens=10_000)] == [near[2].id]
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=10_000)] == [near[3].id]
    assert queue.claim("w1", 8, 0.0, max_tokens=10_000) == []


def test_claim_with_a_token_budget_always_takes_one_job(queue):
    t0 = time.time() - 100
    big = submit(queue, _sized(500, t0, max_tokens=500))
    small = submit(queue, _sized(10, t0 + 1))
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=100)] == [big.id]  # 1000 > 100: alone
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=0)] == [small.id]


def test_claim_with_a_token_budget_waits_only_while_the_group_can_grow(queue):
    t0 = time.time() - 1
    a = submit(queue, _sized(50, t0))
    b = submit(queue, _sized(52, t0 + 0.5))
    # both fit and there is room for more: the group may still fill, so nothing yet
    assert queue.claim("w1", 8, 60.0, max_tokens=1000) == []
    # the budget is what limits the group: full, claimed at once
    assert [j.id for j in queue.claim("w1", 8, 60.0, max_tokens=100)] == [a.id]
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=1000)] == [b.id]


def test_claim_with_a_token_budget_counts_n_and_eviction_bounds(queue):
    t0 = time.time() - 100
    opts = {"budget": 64, "interval": 16}
    a = submit(queue, Job(prompt_ids=[1] * 20, sampling={"max_tokens": 1000}, policy="skipkv", options=opts,
                          created=t0))  # 20 + min(1000, 80) = 100
    b = submit(queue, Job(prompt_ids=[1] * 21, sampling={"max_tokens": 1000}, policy="skipkv", options=opts,
                          created=t0 + 1))  # 101
    c = submit(queue, Job(prompt_ids=[1] * 22, sampling={"max_tokens": 1000, "n": 2}, policy="skipkv",
                          options=opts, created=t0 + 2))  # 2 * 102 = 204
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=300)] == [a.id, b.id]  # c would make 405
    assert [j.id for j in queue.claim("w1", 8, 0.0, max_tokens=300)] == [c.id]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_with_a_token_budget_matches_pick_group(queue, seed):
    from cotserve.queue.base import kv_need

    rng = random.Random(seed)
    lengths = rng.sample(range(1, 200), 24)
    jobs = []
    t0 = time.time() - 100
    for i, n in enumerate(lengths):
        jobs.append(submit(queue, _sized(n, t0 + i, max_tokens=rng.randint(1, 100))))
    remaining = {j.id: j for j in jobs}
    need = {j.id: kv_need(j) for j in jobs}
    while remaining:
        b, budget = rng.randint(1, 6), rng.randint(50, 600)
        oldest = min(remaining.values(), key=lambda j: j.created)
        others = [(j.id, j.prompt_len) for j in remaining.values() if j.id != oldest.id]
        want = pick_group((oldest.id, oldest.prompt_len), others, b, budget, need)
        got = queue.claim("w1", b, 0.0, max_tokens=budget)
        assert [j.id for j in got] == want
        assert len(got) == 1 or sum(need[j.id] for j in got) <= budget
        for j in got:
            del remaining[j.id]


def test_claims_follow_priority_then_arrival(queue):
    """Lower priority values are claimed first (vLLM's convention); equal ones in arrival order,
    also for a job that returns to the queue after its worker was lost."""
    t0 = time.time() - 100
    jobs = {}
    for name, prio, age in (("late-normal", 0, 10), ("urgent", -3, 5), ("early-normal", 0, 1), ("low", 5, 0),
                            ("urgent-later", -3, 20)):
        jobs[name] = submit(queue, Job(prompt_ids=[1, 2, 3], priority=prio, created=t0 + age,
                                       options={"tag": name}))  # own policy keys: one job a claim
    queue.heartbeat("w", ttl=60)
    order = [queue.claim("w", 1, 0.0)[0].id for _ in range(3)]
    names = {j.id: n for n, j in jobs.items()}
    assert [names[i] for i in order] == ["urgent", "urgent-later", "early-normal"]
    # a claimed job handed back keeps its place: before the normal job that came after it
    queue.leave("w")
    again = [names[queue.claim("w2", 1, 0.0)[0].id] for _ in range(5)]
    assert again == ["urgent", "urgent-later", "early-normal", "late-normal", "low"]


def test_a_claimed_group_holds_one_priority(queue):
    """The first job's neighbours in prompt length join its group only at its own priority: a
    low-priority job is never claimed ahead of a more urgent one because its length is close."""
    a = submit(queue, Job(prompt_ids=[1] * 100, priority=-10))
    c = submit(queue, Job(prompt_ids=[1] * 500, priority=-9))
    d = submit(queue, Job(prompt_ids=[1] * 101, priority=10_000))
    queue.heartbeat("w", ttl=60)
    groups = [[j.id for j in queue.claim("w", 2, 0.0)] for _ in range(3)]
    assert groups == [[a.id], [c.id], [d.id]]


def test_arrival_order_holds_at_the_priority_limit(queue):
    """Within one priority, jobs 10 ms apart are claimed in arrival order, also at the limit
    (the Redis rank's resolution there)."""
    t0 = time.time()
    for prio in (10_000, -10_000):
        jobs = [submit(queue, Job(prompt_ids=[1, 2], priority=prio, created=t0 + i * 0.01, options={"i": i}))
                for i in range(5)]
        queue.heartbeat("w", ttl=60)
        got = [queue.claim("w", 1, 0.0)[0].id for _ in jobs]
        assert got == [j.id for j in jobs]


def test_a_worker_reads_a_newer_gateways_jobs():
    """Fields a worker does not know (a newer gateway's) are left out, not an error."""
    import json

    d = json.loads(Job(prompt_ids=[1, 2], priority=3).to_json())
    d["a_later_field"] = {"x": 1}
    job = Job.from_json(json.dumps(d))
    assert job.prompt_ids == [1, 2] and job.priority == 3
