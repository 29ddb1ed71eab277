"""The continuous worker (`cotserve/worker/continuous.py`) on a real Redis queue and the bundled
model: a job claimed while another decodes joins at once and finishes first; a cancelled job's
slot goes to the next job at the next step; `--scheduler` picks the loop."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import CotserveError
from cotserve.queue import Job
from cotserve.worker import ContinuousWorker, Worker, make_worker

REDIS_URL = "redis://127.0.0.1:6379/5"


@pytest.fixture()
def queue():
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    from cotserve.queue.redis_queue import RedisQueue

    q = RedisQueue(REDIS_URL, prefix=f"cotserve-test-cb-{uuid.uuid4().hex[:8]}:", result_ttl=60)
    yield q
    q.drop_all()
    q.close()


def _submit(engine, q, prompt: str, n: int) -> Job:
    job = Job(prompt_ids=engine.encode_prompt(prompt, chat=False),
              sampling={"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
    asyncio.run(q.submit(job, 16))
    return job


def _state(q, job: Job) -> tuple[list[int], dict | None]:
    events = q.published(job.id)
    ids = [t for e in events if e["t"] == "delta" for t in e["ids"]]
    done = next((e for e in events if e["t"] in ("done", "error")), None)
    return ids, done


def _alone(engine, prompt: str, n: int) -> list[int]:
    req = GenRequest(engine.encode_prompt(prompt, chat=False), SamplingParams(max_tokens=n, ignore_eos=True))
    return engine.generate([req])[0].token_ids


def _until(worker, pred, limit: int = 200) -> int:
    for i in range(limit):
        if pred():
            return i
        worker.run_once()
    raise AssertionError("the worker did not get there")


def test_a_job_joins_the_running_batch_and_finishes_first(engine, queue):
    w = ContinuousWorker(engine, queue, worker_id="w-cb", max_batch=4, max_wait=0.0)
    queue.heartbeat("w-cb", 60)
    long = _submit(engine, queue, "Once upon a time", 24)
    _until(w, lambda: len(_state(queue, long)[0]) >= 3)
    short = _submit(engine, queue, "Hi", 3)
    _until(w, lambda: _state(queue, short)[1] is not None)
    ids, done = _state(queue, long)
    assert done is None and 3 <= len(ids) < 24  # the long job is still decoding
    s_ids, s_done = _state(queue, short)
    assert s_ids == _alone(engine, "Hi", 3) and s_done["t"] == "done"
    assert s_done["telemetry"]["scheduler"] == "continuous" and s_done["telemetry"]["batch_size"] == 2
    _until(w, lambda: _state(queue, long)[1] is not None)
    assert _state(queue, long)[0] == _alone(engine, "Once upon a time", 24)
    assert w.pool.idle and queue.r.scard(queue.k("claimed", "w-cb")) == 0


def test_cancel_frees_the_slot_for_the_next_job(engine, queue):
    w = ContinuousWorker(engine, queue, worker_id="w-cb1", max_batch=1, max_wait=0.0, cancel_poll_s=0.0)
    queue.heartbeat("w-cb1", 60)
    long = _submit(engine, queue, "Once upon a time", 500)
    nxt = _submit(engine, queue, "Hi", 2)
    _until(w, lambda: len(_state(queue, long)[0]) >= 2)
    assert queue.r.zcard(queue.k("pending")) == 1  # one slot: the next job waits
    asyncio.run(queue.cancel(long.id))
    steps = _until(w, lambda: _state(queue, nxt)[1] is not None)
    assert steps <= 5  # cancel step (+ claim and prefill), one decode step, no wait for 500 tokens
    ids, done = _state(queue, long)
    assert done is not None and done["finish_reason"] == "cancelled" and len(ids) < 20
    assert _state(queue, nxt)[0] == _alone(engine, "Hi", 2)


def test_scheduler_choice(engine, queue):
    assert type(make_worker(engine, queue, "static", worker_id="a")) is Worker
    w = make_worker(engine, queue, "continuous", worker_id="b", max_batch=3, pool_len=777)
    assert isinstance(w, ContinuousWorker) and w.pool.pool_len == 777 and w.pool.slots == 3
    with pytest.raises(CotserveError, match="scheduler"):
        make_worker(engine, queue, "fifo")


def test_a_bad_pool_length_is_refused_by_the_cli():
    from typer.testing import CliRunner

    from cotserve.cli import app

    got = CliRunner().invoke(app, ["worker", "--redis-url", "redis://127.0.0.1:6379/15", "--pool-len", "1"])
    assert got.exit_code != 0 and "--pool-len must be at least 2" in got.output


def test_embedded_server_with_the_continuous_worker_streams_and_bench_reports_itl(engine):
    """The embedded mode's wiring (gateway, in-process queue, continuous worker thread) under
    `bench serve`: every stream completes; time to first token and inter-token percentiles."""
    import threading

    import httpx
    from support import ServerThread

    from cotserve.bench.serve import run_serve_bench
    from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
    from cotserve.queue import InProcessQueue

    q = InProcessQueue()
    app = create_app(GatewaySettings(model_name="m"), q, PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = make_worker(engine, q, "continuous", 64, worker_id="w-emb", max_batch=3)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    srv = ServerThread(app)
    url = srv.start()
    try:
        assert httpx.get(url + "/ready", timeout=10).status_code == 200
        rep = run_serve_bench(url, concurrency=3, requests=5, stream=True, max_tokens=4)
    finally:
        srv.stop()
        worker.stop()
        thread.join(timeout=60)
    assert rep["ok"] == 5 and rep["errors"] == 0
    assert set(rep["itl_s"]) == {"p50", "p95", "p99", "mean"} and 0 < rep["itl_s"]["p50"] <= rep["latency_s"]["p99"]
    assert rep["ttft_s"]["p50"] <= rep["latency_s"]["p50"]


def test_a_bad_request_fails_alone_and_running_leases_are_renewed(engine, queue):
    """A job with a policy the worker refuses gets its 400 error event while another job keeps
    decoding; the running job's claim is on the list the heartbeat renews."""
    w = ContinuousWorker(engine, queue, worker_id="w-cb-bad", max_batch=4, max_wait=0.0)
    queue.heartbeat("w-cb-bad", 60)
    good = _submit(engine, queue, "Once upon a time", 12)
    _until(w, lambda: len(_state(queue, good)[0]) >= 2)
    assert good.id in w._running
    bad = Job(prompt_ids=engine.encode_prompt("Hi", chat=False), sampling={"max_tokens": 3},
              policy="sfi", options={"k": 0})
    asyncio.run(queue.submit(bad, 16))
    _until(w, lambda: _state(queue, bad)[1] is not None)
    err = _state(queue, bad)[1]
    assert err["t"] == "error" and err["status"] == 400
    _until(w, lambda: _state(queue, good)[1] is not None)
    assert _state(queue, good)[0] == _alone(engine, "Once upon a time", 12)
    assert good.id not in w._running
