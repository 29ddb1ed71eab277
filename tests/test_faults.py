"""Fault injection on loopback, bounded in time, on our own redis-server (a free port, append-only
file on): a Redis restart mid-stream (the worker in a thread on the shared bundled model), and
every worker process killed mid-stream (real `cotserve worker` processes). The gateway is served
from this process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support import ServerThread, free_port

from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.worker import Worker

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Count from one to twenty in words.", "List the colours of the rainbow.", "Name five fruits."]


class OwnRedis:
    def __init__(self, tmp_path):
        self.port = free_port()
        self.dir = tmp_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.RedisError:
                assert time.time() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)


def _stream(url: str, prompt: str) -> tuple[str, list[str]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, errors = "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                errors.append(obj["error"]["code"])
            for c in obj.get("choices", []):
                text += c["delta"].get("content") or ""
    return text, errors


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.parametrize("outage_s", [2.0, 5.0])
def test_redis_restart_mid_stream_loses_nothing(engine, tmp_path, outage_s):
    """Redis killed while three streams run, started again from its AOF `outage_s` later."""
    import redis

    from cotserve.queue.redis_queue import RedisQueue

    rs = OwnRedis(tmp_path)
    rs.start()
    prefix = f"cotserve-fault-{uuid.uuid4().hex[:6]}:"
    gq = RedisQueue(rs.url, prefix=prefix)
    wq = RedisQueue(rs.url, prefix=prefix)
    app = create_app(GatewaySettings(model_name=MODEL, keepalive_s=0.5), gq,
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = Worker(engine, wq, worker_id="w-fault", max_batch=4, max_wait=0.5, heartbeat_s=1.0)
    wt = threading.Thread(target=worker.run, daemon=True)
    wt.start()
    try:
        with ServerThread(app) as url:
            deadline = time.time() + 30
            while httpx.get(url + "/ready").status_code != 200:
                assert time.time() < deadline
                time.sleep(0.1)
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                baseline = list(ex.map(lambda p: _stream(url, p), PROMPTS))
            assert all(not errs and text for text, errs in baseline)

            before = set(redis.Redis.from_url(rs.url, decode_responses=True).scan_iter(match=prefix + "out:*"))
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                futures = [ex.submit(_stream, url, p) for p in PROMPTS]
                # wait until the batch is decoding, then restart Redis after `outage_s`
                r = redis.Redis.from_url(rs.url, decode_responses=True)
                run_id = r.info("server")["run_id"]
                _wait_streaming(r, prefix, before)
                in_flight = sum(not f.done() for f in futures)
                rs.kill()
                time.sleep(outage_s)
                rs.start()
                results = [f.result(timeout=120) for f in futures]
            assert in_flight == len(PROMPTS)
            # the restart happened while the streams ran (a new server process, the AOF kept the jobs)
            assert redis.Redis.from_url(rs.url).info("server")["run_id"] != run_id
            assert [t for t, _ in results] == [t for t, _ in baseline]
            assert all(not errs for _, errs in results), results

            # nothing stays claimed, /ready is true again within 5 s
            deadline = time.time() + 5
            while True:
                resp = httpx.get(url + "/ready")
                if resp.status_code == 200 and resp.json()["running"] == 0 and resp.json()["pending"] == 0:
                    break
                assert time.time() < deadline, resp.text
                time.sleep(0.1)
            r = redis.Redis.from_url(rs.url, decode_responses=True)
            assert not any(r.scard(k) for k in r.scan_iter(match=prefix + "claimed:*"))
            assert r.zcard(prefix + "leases") == 0
    finally:
        worker.stop()
        wt.join(timeout=30)
        if rs.proc is not None and rs.proc.poll() is None:
            rs.kill()


def _wait_ready(url: str, timeout: float, idle: bool = False) -> httpx.Response:
    """/ready is 200 (and, with idle, nothing pending or running) within `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        resp = httpx.get(url + "/ready", timeout=5)
        if resp.status_code == 200 and (not idle or (resp.json()["running"] == 0 and resp.json()["pending"] == 0)):
            return resp
        assert time.time() < deadline, resp.text
        time.sleep(0.1)


def _worker_process(rs: OwnRedis, prefix: str, name: str, log_dir) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "cotserve.cli", "worker", "--redis-url", rs.url,
                             "--key-prefix", prefix, "--worker-id", name, "--max-batch", "4", "--batch-wait", "0.5",
                             "--device", "cpu", "--dtype", "float32", "--threads", "1", "--heartbeat", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_streaming(r, prefix: str, before: set[str], timeout: float = 60) -> None:
    """A stream that was not there `before` has a few events (the new batch is decoding)."""
    deadline = time.time() + timeout
    while not any(r.xlen(k) > 2 for k in r.scan_iter(match=prefix + "out:*") if k not in before):
        assert time.time() < deadline, "no stream started"
        time.sleep(0.02)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.slow
def test_all_workers_killed_mid_stream_then_one_restarted(engine, tmp_path):
    """SIGKILL to both worker processes while three streams run; a new worker starts: the leases
    return the jobs, the new worker resumes them, every stream ends with the baseline text."""
    import redis

    from cotserve.queue.redis_queue import RedisQueue

    rs = OwnRedis(tmp_path)
    rs.start()
    prefix = f"cotserve-kill-{uuid.uuid4().hex[:6]}:"
    app = create_app(GatewaySettings(model_name=MODEL, keepalive_s=0.5), RedisQueue(rs.url, prefix=prefix),
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    procs = [_worker_process(rs, prefix, f"w{i}", tmp_path) for i in range(2)]
    try:
        with ServerThread(app) as url:
            _wait_ready(url, 180)
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                baseline = list(ex.map(lambda p: _stream(url, p), PROMPTS))
            assert all(not errs and text for text, errs in baseline), baseline

            r = redis.Redis.from_url(rs.url, decode_responses=True)
            before = set(r.scan_iter(match=prefix + "out:*"))
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                futures = [ex.submit(_stream, url, p) for p in PROMPTS]
                _wait_streaming(r, prefix, before)
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait(timeout=10)
                in_flight = sum(not f.done() for f in futures)
                claimed = sum(r.scard(k) for k in r.scan_iter(match=prefix + "claimed:*"))
                procs.append(_worker_process(rs, prefix, "w-new", tmp_path))
                results = [f.result(timeout=240) for f in futures]
            assert in_flight == len(PROMPTS) and claimed > 0
            assert [t for t, _ in results] == [t for t, _ in baseline]
            assert all(not errs for _, errs in results), results

            _wait_ready(url, 5, idle=True)
            assert not any(r.scard(k) for k in r.scan_iter(match=prefix + "claimed:*"))
            assert r.zcard(prefix + "leases") == 0
            attempts = [int(r.hget(k, "attempts")) for k in r.scan_iter(match=prefix + "job:*")]
            assert max(attempts) >= 2, attempts  # the restarted worker ran the jobs again
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if rs.proc is not None and rs.proc.poll() is None:
            rs.kill()


class _LostReplies:
    """A real Redis queue whose publish replies are lost every other call: the script runs on
    Redis, then the worker sees QueueUnavailable and retries. A lost reply cannot be caused on
    demand with a real network on loopback, so the loss is made here, after the call succeeded."""

    def __init__(self, queue):
        self.queue = queue
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.queue, name)

    def publish(self, *args, **kwargs):
        from cotserve.queue.base import QueueUnavailable

        ok = self.queue.publish(*args, **kwargs)
        self.calls += 1
        if self.calls % 2:
            raise QueueUnavailable("redis: the reply was lost")
        return ok


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_lost_publish_replies_add_no_duplicate_events(engine, tmp_path):
    from cotserve.queue.redis_queue import RedisQueue

    rs = OwnRedis(tmp_path)
    rs.start()
    prefix = f"cotserve-lost-{uuid.uuid4().hex[:6]}:"
    app = create_app(GatewaySettings(model_name=MODEL, keepalive_s=0.5), RedisQueue(rs.url, prefix=prefix),
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    plain = Worker(engine, RedisQueue(rs.url, prefix=prefix), worker_id="w-plain", max_batch=4, max_wait=0.5)
    lossy = _LostReplies(RedisQueue(rs.url, prefix=prefix))
    try:
        with ServerThread(app) as url:
            results = {}
            for name, worker in (("plain", plain),
                                 ("lossy", Worker(engine, lossy, worker_id="w-lossy", max_batch=4, max_wait=0.5))):
                wt = threading.Thread(target=worker.run, daemon=True)
                wt.start()
                try:
                    _wait_ready(url, 30)
                    with ThreadPoolExecutor(len(PROMPTS)) as ex:
                        results[name] = list(ex.map(lambda p: _stream(url, p), PROMPTS))
                finally:
                    worker.stop()
                    wt.join(timeout=30)
            assert lossy.calls > 10
            assert all(not errs and text for text, errs in results["plain"]), results
            assert results["lossy"] == results["plain"]
    finally:
        if rs.proc is not None and rs.proc.poll() is None:
            rs.kill()
