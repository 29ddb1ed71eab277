"""Scale-out on a real Redis: a gateway (served from this process) plus two `cotserve worker`
subprocesses sharing one queue (db 5, random key prefix). A burst is shared by both workers; a
worker killed with SIGKILL mid-stream loses nothing: its job returns to pending, the other worker
finishes it and the stream continues without repeating what was already sent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import ServerThread

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app

REDIS_URL = "redis://127.0.0.1:6379/5"
MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parent.parent


def wait_for(pred, timeout=120.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_worker(prefix: str, wid: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "cotserve.cli", "worker", "--redis-url", REDIS_URL, "--key-prefix", prefix,
         "--worker-id", wid, "--max-batch", "2", "--heartbeat", "0.5", "--threads", "1", "--device", "cpu"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def cluster(engine):
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    from cotserve.queue.redis_queue import RedisQueue

    prefix = f"cotserve-test-{uuid.uuid4().hex[:8]}:"
    queue = RedisQueue(REDIS_URL, prefix=prefix, result_ttl=120)
    app = create_app(GatewaySettings(model_name=MODEL), queue,
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    workers = {wid: start_worker(prefix, wid) for wid in ("wa", "wb")}
    server = ServerThread(app)
    url = server.start()
    try:
        def ready():
            for wid, p in workers.items():
                if p.poll() is not None:
                    raise AssertionError(f"worker {wid} exited: {p.stderr.read().decode()[-2000:]}")
            r = httpx.get(url + "/ready")
            return r.status_code == 200 and r.json()["workers"] == 2

        wait_for(ready, timeout=180, what="two workers")
        yield {"url": url, "queue": queue, "workers": workers}
    finally:
        server.stop()
        for p in workers.values():
            if p.poll() is None:
                p.terminate()
        for p in workers.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        queue.drop_all()
        queue.close()


def test_two_workers_share_a_burst(cluster):
    prompts = ["What is 2+2?", "Name a colour.", "Hi", "Say hello in French.", "Count to three.",
               "What is the capital of France?", "Name a fruit.", "Is the sun a star?"]

    def one(p):
        r = httpx.post(cluster["url"] + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(prompts)) as ex:
        results = list(ex.map(one, prompts))
    used = {r["cotserve"]["worker"] for r in results}
    assert used == {"wa", "wb"}
    assert all(r["usage"]["completion_tokens"] >= 1 for r in results)
    q = cluster["queue"]
    assert q.r.zcard(q.k("pending")) == 0
    # a worker releases its claim right after it publishes the last event, which the client may
    # read first: the claim sets must drain, within a few seconds on a loaded machine
    deadline = time.monotonic() + 15
    while any(q.r.scard(q.k("claimed", w)) for w in ("wa", "wb")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(q.r.scard(q.k("claimed", w)) == 0 for w in ("wa", "wb"))


def test_sigkill_mid_stream_loses_nothing(cluster, engine):
    prompt = "Write a long story about a lighthouse keeper."
    n = 48
    ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
    (ref,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=n, ignore_eos=True))])
    q = cluster["queue"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    objs = []
    killed = None
    with httpx.stream("POST", cluster["url"] + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            objs.append(obj)
            assert "error" not in obj, obj
            if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                pieces.append(obj["choices"][0]["delta"]["content"])
                if len(pieces) == 4 and killed is None:
                    owner = q.r.hget(q.k("job", obj["id"]), "worker")
                    killed = owner
                    cluster["workers"][owner].send_signal(signal.SIGKILL)
    assert killed in ("wa", "wb")
    assert "".join(pieces) == ref.text  # nothing repeated, nothing lost
    final = objs[-1]
    assert final["usage"]["completion_tokens"] == n
    assert final["cotserve"]["attempt"] == 2 and final["cotserve"]["worker"] != killed
