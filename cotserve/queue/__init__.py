"""Job queue between gateway and workers: Redis for scale-out, in-process for the embedded default."""

from cotserve.queue.base import Job, JobQueue, QueueFull, QueueUnavailable, pick_group, policy_key
from cotserve.queue.memory import InProcessQueue


def make_queue(redis_url: str | None, prefix: str = "cotserve:", result_ttl: int = 300) -> JobQueue:
    if not redis_url:
        return InProcessQueue(result_ttl=result_ttl)
    from cotserve.queue.redis_queue import RedisQueue

    return RedisQueue(redis_url, prefix=prefix, result_ttl=result_ttl)


__all__ = ["Job", "JobQueue", "QueueFull", "QueueUnavailable", "InProcessQueue", "make_queue", "pick_group",
           "policy_key"]
