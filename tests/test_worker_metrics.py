"""`cotserve worker` processes on a real Redis (db 5, own key prefix), one per scheduler, each
with `--metrics-port` (given through COTSERVE_WORKER_METRICS_PORT) and JSON logs: a job sent
through the queue moves the worker's Prometheus counters and histograms, and leaves its request
line and the periodic stats line in the worker's log."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port

from cotserve.queue.base import Job

REDIS_URL = "redis://127.0.0.1:6379/5"
ROOT = Path(__file__).resolve().parent.parent
SCHEDULERS = ("static", "continuous")
TOKENS = 6


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited: {log.read_text()[-3000:] if log else ''}")
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def workers(engine, tmp_path_factory):
    """Two workers (static, continuous), each having run one greedy job of TOKENS tokens."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    from cotserve.queue.redis_queue import RedisQueue

    logs = tmp_path_factory.mktemp("worker-logs")
    out = {}
    procs = []
    try:
        for scheduler in SCHEDULERS:
            prefix = f"cotserve-test-wm-{uuid.uuid4().hex[:8]}:"
            port = free_port()
            log = logs / f"{scheduler}.log"
            env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                       COTSERVE_WORKER_METRICS_PORT=str(port))
            with log.open("wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "cotserve.cli", "--log-format", "json", "worker", "--redis-url", REDIS_URL,
                     "--key-prefix", prefix, "--worker-id", f"w-{scheduler}", "--scheduler", scheduler,
                     "--max-batch", "2", "--heartbeat", "0.5", "--stats-interval", "0.5", "--threads", "1",
                     "--device", "cpu"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            procs.append(proc)
            out[scheduler] = {"proc": proc, "log": log, "url": f"http://127.0.0.1:{port}/metrics",
                              "queue": RedisQueue(REDIS_URL, prefix=prefix, result_ttl=120)}
        prompt = engine.encode_prompt("Name a colour.")
        for scheduler, w in out.items():
            def up(url=w["url"]):
                try:
                    return httpx.get(url, timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            _wait_for(up, 180, f"the {scheduler} worker's metrics", w["proc"], w["log"])
            w["before"] = _scrape(w["url"])
            w["job"] = job = Job(prompt_ids=prompt, sampling={"max_tokens": TOKENS, "temperature": 0.0,
                                                              "ignore_eos": True})
            asyncio.run(w["queue"].submit(job, 16))
        for scheduler, w in out.items():
            def done(w=w):
                return next((e for e in w["queue"].published(w["job"].id) if e["t"] in ("done", "error")), None)

            w["done"] = _wait_for(done, 300, f"the {scheduler} worker's job", w["proc"], w["log"])
            w["after"] = _scrape(w["url"])
        yield out
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for w in out.values():
            w["queue"].drop_all()
            w["queue"].close()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_worker_metrics_move_with_a_job(workers, scheduler):
    w = workers[scheduler]
    wid = f"w-{scheduler}"
    assert w["done"]["t"] == "done" and w["done"]["usage"]["completion_tokens"] == TOKENS
    before, after = w["before"], w["after"]
    # served before the job, counting nothing yet
    assert _value(before, "cotserve_worker_generated_tokens_total", worker_id=wid) == 0
    assert _value(before, "cotserve_worker_requests_total", worker_id=wid, finish_reason="length") == 0
    assert _value(after, "cotserve_worker_generated_tokens_total", worker_id=wid) == TOKENS
    assert _value(after, "cotserve_worker_requests_total", worker_id=wid, finish_reason="length") == 1
    assert _value(after, "cotserve_worker_prompt_tokens_total", worker_id=wid) == len(w["job"].prompt_ids)
    assert _value(after, "cotserve_worker_time_to_first_token_seconds_count", worker_id=wid) == 1
    assert _value(after, "cotserve_worker_queue_wait_seconds_count", worker_id=wid) == 1
    # one token per step: a gap before each token but the first
    assert _value(after, "cotserve_worker_inter_token_latency_seconds_count", worker_id=wid) == TOKENS - 1
    assert _value(after, "cotserve_worker_request_generation_tokens_sum", worker_id=wid, policy="dense") == TOKENS
    assert _value(after, "cotserve_worker_request_generation_tokens_count", worker_id=wid, policy="dense") == 1
    assert _value(after, "cotserve_worker_decode_tokens_per_second_count", worker_id=wid, policy="dense") == 1
    assert _value(after, "cotserve_worker_policy_ratio_count", worker_id=wid, policy="dense",
                  key="padding_fraction") == 1
    assert _value(after, "cotserve_worker_requests_running", worker_id=wid) == 0
    assert not [k for k in after if k[0].startswith("cotserve_worker_") and ("worker_id", wid) not in k[1]]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_worker_logs_the_request_and_its_stats(workers, scheduler):
    w = workers[scheduler]
    wid, job = f"w-{scheduler}", w["job"]

    def records():
        out = []
        for line in w["log"].read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def stats_after_the_job():
        lines = [r for r in records() if r["logger"] == "cotserve.worker" and r["message"].startswith("stats ")]
        return lines if lines and lines[-1]["requests_total"] == 1 else None

    stats = _wait_for(stats_after_the_job, 60, "a stats line counting the job", w["proc"], w["log"])
    assert all(r["worker"] == wid and r["scheduler"] == scheduler for r in stats)
    assert sum(r["generated_tokens"] for r in stats) == TOKENS
    assert sum(r["finished"] for r in stats) == 1 and all(r["tok_s"] >= 0 for r in stats)
    (req,) = [r for r in records() if r["logger"] == "cotserve.requests"]
    assert req["request_id"] == job.id and req["worker"] == wid and req["generated_tokens"] == TOKENS
    assert req["finish_reason"] == "length" and req["policy"] == "dense" and req["ttft_s"] > 0
    assert f"request_id={job.id}" in req["message"]
