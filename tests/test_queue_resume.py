"""Worker resume logic, in-process: a job whose first worker stopped after publishing part of its
stream is finished by another worker without repeating anything, or ends with an error event.

The first worker's death is played by hand (a claim, a publish, then its heartbeat expires): the
SIGKILL of a real worker process is in test_queue_workers.py; here the partial streams can be
chosen exactly, including a diverging one that a real run would only produce by accident."""

from __future__ import annotations

import asyncio
import time

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.queue import InProcessQueue, Job
from cotserve.worker import Worker

PROMPT = "Tell me about the moon."
N = 10


def first_attempt(engine, sampling: dict, publish_tokens: int, tamper: bool = False):
    """Queue a job, let worker 'dead' stream its first tokens, then let its heartbeat run out."""
    q = InProcessQueue()
    ids = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    job = Job(prompt_ids=ids, sampling=sampling)
    asyncio.run(q.submit(job, 10))
    q.heartbeat("dead", ttl=0.1)
    q.claim("dead", 1, 0.0)
    req = GenRequest(ids, SamplingParams(**sampling), request_id=job.id)
    sent = 0
    for deltas in engine.stream([req], "dense"):
        for d in deltas:
            if sent < publish_tokens and d.token_ids:
                tok = [99] if tamper else d.token_ids
                q.publish("dead", job.id, [{"t": "delta", "ids": tok, "text": d.text}])
                sent += 1
    time.sleep(0.2)
    return q, job


def finish_on_other_worker(engine, q):
    w = Worker(engine, q, worker_id="alive", heartbeat_s=0.05)
    q.heartbeat("alive", ttl=60)
    assert w.run_once() == 1
    return q


def test_resume_continues_without_repeating(engine):
    sampling = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    ids = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    (ref,) = engine.generate([GenRequest(ids, SamplingParams(**sampling))])
    q, job = first_attempt(engine, sampling, publish_tokens=4)
    finish_on_other_worker(engine, q)
    events = q.published(job.id)
    deltas = [e for e in events if e["t"] == "delta"]
    assert [t for e in deltas for t in e["ids"]] == ref.token_ids
    assert "".join(e["text"] for e in deltas) == ref.text
    assert events[-1]["t"] == "done" and events[-1]["telemetry"]["attempt"] == 2
    assert events[-1]["usage"]["completion_tokens"] == N


def test_seeded_sampling_resumes(engine):
    sampling = {"max_tokens": N, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    ids = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    (ref,) = engine.generate([GenRequest(ids, SamplingParams(**sampling))])
    q, job = first_attempt(engine, sampling, publish_tokens=3)
    finish_on_other_worker(engine, q)
    deltas = [e for e in q.published(job.id) if e["t"] == "delta"]
    assert "".join(e["text"] for e in deltas) == ref.text


def test_unseeded_partial_stream_gets_an_error(engine):
    sampling = {"max_tokens": N, "temperature": 1.0, "seed": None, "ignore_eos": True}
    q, job = first_attempt(engine, sampling, publish_tokens=2)
    finish_on_other_worker(engine, q)
    events = q.published(job.id)
    assert [e["t"] for e in events] == ["delta", "delta", "error"]
    assert events[-1]["code"] == "worker_lost"


def test_diverging_retry_gets_an_error_not_a_different_stream(engine):
    sampling = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    q, job = first_attempt(engine, sampling, publish_tokens=2, tamper=True)
    finish_on_other_worker(engine, q)
    events = q.published(job.id)
    assert [e["t"] for e in events] == ["delta", "delta", "error"]
    assert events[-1]["code"] == "worker_lost"


def test_unstarted_job_is_simply_rerun(engine):
    sampling = {"max_tokens": 4, "temperature": 1.0, "seed": None}
    q, job = first_attempt(engine, sampling, publish_tokens=0)
    finish_on_other_worker(engine, q)
    assert q.published(job.id)[-1]["t"] == "done"


def test_job_past_its_deadline_fails_with_503(engine):
    q = InProcessQueue()
    job = Job(prompt_ids=engine.apply_chat_template([{"role": "user", "content": "Hi"}]),
              sampling={"max_tokens": 2}, created=time.time() - 10, deadline=time.time() - 1)
    asyncio.run(q.submit(job, 10))
    Worker(engine, q, worker_id="w").run_once()
    (ev,) = q.published(job.id)
    assert ev["t"] == "error" and ev["status"] == 503 and ev["code"] == "queue_timeout"
