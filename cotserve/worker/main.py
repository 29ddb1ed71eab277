"""The worker's entry points: `cotserve worker` (a process serving a Redis queue) and the embedded
worker thread of `cotserve serve` (no Redis: the gateway's in-process queue).

Both build the engine from `EngineArgs` (cotserve's native engine, or vLLM with the cotserve
plugin) and run the worker loop of `--scheduler` on it (`make_worker`). `cotserve worker
--metrics-port` serves the worker's Prometheus metrics (`worker/metrics.py`) over HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import CotserveError, ModelError, redact_paths

log = logging.getLogger("cotserve.worker")


@dataclass
class EngineArgs:
    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int | None = None  # native: its slots (8 when unset); vllm: this worker's sequences in flight
    # (default: vLLM's max_num_seqs)
    max_wait: float = 0.02
    threads: int | None = None
    engine: str = "native"  # native | vllm
    vllm_options: dict[str, Any] = field(default_factory=dict)  # VLLMOptions fields (--engine vllm)
    scheduler: str = "continuous"  # continuous | static (worker/continuous.py, make_worker)
    prefill_chunk: int = 256  # continuous: prompt tokens prefilled per engine step
    pool_len: int = 4096  # continuous, CUDA: KV entries per slot of the pooled (captured) decode step
    bench_replay: str | None = None  # benchmarks only: replies follow this text (engine/replay.py), not the model


def make_engine(engine_args: EngineArgs):
    """The worker's engine: cotserve's native engine, or vLLM with the cotserve plugin. Any failure
    to start is a CotserveError with a one-line reason (the server log has the rest)."""
    try:
        return _make_engine(engine_args)
    except CotserveError:
        raise
    except Exception as exc:
        log.debug("the engine did not start", exc_info=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"the {engine_args.engine} engine did not start: {type(exc).__name__}"
                         + (f": {redact_paths(first)}" if first else "")) from exc


def bench_replay(engine, engine_args: EngineArgs):
    """The replayed text of `--bench-replay` in the engine's vocabulary (None when off)."""
    if not engine_args.bench_replay:
        return None
    from cotserve.engine.replay import load_replay

    replay = load_replay(engine_args.bench_replay, engine.tokenizer)
    log.warning("benchmark replay is on: every reply follows the text of %s (%d tokens), not the model's choices",
                replay.source, len(replay.ids))
    return replay


def _make_engine(engine_args: EngineArgs):
    if engine_args.engine == "vllm":
        from cotserve.vllm.engine import VLLMEngine, VLLMOptions

        return VLLMEngine(engine_args.model, device=engine_args.device, dtype=engine_args.dtype,
                          options=VLLMOptions(**engine_args.vllm_options, bench_replay=bool(engine_args.bench_replay)))
    if engine_args.engine != "native":
        raise CotserveError(f"unknown engine {engine_args.engine!r} (native or vllm)")
    from cotserve.engine.native import NativeEngine
    from cotserve.models import load_model

    return NativeEngine(load_model(engine_args.model, device=engine_args.device, dtype=engine_args.dtype),
                        max_batch=engine_args.max_batch or 8)


class EmbeddedWorker:
    """The worker thread of `cotserve serve` without Redis: loads the engine, serves the queue,
    restarts the engine when it dies. `error` is set (and `on_fatal` called) when the engine cannot
    load or be restarted; `close` stops the worker and the engine's processes."""

    def __init__(self, engine_args: EngineArgs, queue, worker_id: str = "embedded",
                 on_fatal: Callable[[str], None] | None = None):
        self.engine_args = engine_args
        self.queue = queue
        self.worker_id = worker_id
        self.on_fatal = on_fatal
        self.worker = None
        self.error: str | None = None
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cotserve-worker", daemon=True)

    def start(self) -> EmbeddedWorker:
        self.thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def _run(self) -> None:
        from cotserve.worker.continuous import make_worker

        try:
            engine = make_engine(self.engine_args)
            if self._stopping.is_set():  # shut down while it loaded
                _close(engine)
                return
            self.worker = make_worker(engine, self.queue, self.engine_args.scheduler, self.engine_args.prefill_chunk,
                                      pool_len=self.engine_args.pool_len, worker_id=self.worker_id,
                                      max_batch=self.engine_args.max_batch, max_wait=self.engine_args.max_wait,
                                      restart=lambda: make_engine(self.engine_args),
                                      replay=bench_replay(engine, self.engine_args))
            if self._stopping.is_set():
                _close(engine)
                return
            self.worker.run()
        except CotserveError as exc:
            self._fatal(str(exc))
        except Exception as exc:
            log.exception("the worker stopped")
            self._fatal(f"the worker stopped: {type(exc).__name__}: {redact_paths(str(exc))}")

    def _fatal(self, reason: str) -> None:
        self.error = reason
        log.error("%s", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def close(self, timeout: float = 5.0) -> None:
        """Stop claiming, let the worker loop end, close the engine (each step up to `timeout`)."""
        self._stopping.set()
        w = self.worker
        if w is not None:
            w.stop()
            self.thread.join(timeout)
            _close(w.engine, timeout)


def _close(engine, timeout: float | None = None) -> None:
    """Close `engine` (vLLM: its engine processes end), waiting at most `timeout` seconds."""
    close = getattr(engine, "close", None)
    if close is None:
        return

    def run() -> None:
        try:
            close()
        except Exception:
            log.warning("closing the engine failed", exc_info=True)

    if timeout is None:
        run()
        return
    t = threading.Thread(target=run, name="cotserve-engine-close", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        log.warning("the engine did not close within %.0f s", timeout)


def start_worker_thread(engine_args: EngineArgs, queue, worker_id: str = "embedded",
                        on_fatal: Callable[[str], None] | None = None) -> EmbeddedWorker:
    """Load the model and serve `queue` from a daemon thread (the embedded default)."""
    return EmbeddedWorker(engine_args, queue, worker_id, on_fatal).start()


def run_worker(redis_url: str, key_prefix: str, engine_args: EngineArgs, worker_id: str | None = None,
               heartbeat_s: float = 1.0, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
               stats_s: float = 10.0) -> None:
    """`cotserve worker`: serve the Redis queue at `redis_url` until SIGTERM or SIGINT; with
    `metrics_port`, Prometheus text on http://metrics_host:metrics_port/metrics (from before the
    model loads, so a taken port fails at once)."""
    import signal

    from cotserve.queue import make_queue
    from cotserve.worker.continuous import make_worker
    from cotserve.worker.events import default_worker_id
    from cotserve.worker.metrics import WorkerMetrics

    set_threads(engine_args.threads)
    queue = make_queue(redis_url, prefix=key_prefix)
    check_redis(queue, redis_url)
    worker_id = worker_id or default_worker_id()
    metrics = WorkerMetrics(worker_id)
    server = None
    if metrics_port is not None:
        server = serve_metrics(metrics, metrics_host, metrics_port)
    try:
        engine = make_engine(engine_args)
        worker = make_worker(engine, queue, engine_args.scheduler, engine_args.prefill_chunk, pool_len=engine_args.pool_len, worker_id=worker_id,
                             max_batch=engine_args.max_batch, max_wait=engine_args.max_wait,
                             heartbeat_s=heartbeat_s, stats_s=stats_s, metrics=metrics,
                             restart=lambda: make_engine(engine_args), replay=bench_replay(engine, engine_args))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
        log.info("worker %s serving %s from %s (prefix %r, %s scheduler)", worker.worker_id, engine_args.model,
                 redis_url, key_prefix, worker.scheduler)
        try:
            worker.run()
        finally:
            _close(worker.engine)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def serve_metrics(metrics, host: str, port: int):
    """Serve `metrics`' registry as Prometheus text on http://host:port/metrics from a daemon
    thread; returns the server (its `shutdown()` stops it)."""
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise CotserveError(f"cannot serve worker metrics on {host}:{port}: {exc}") from exc
    log.info("worker metrics on http://%s:%d/metrics", host, server.server_port)
    return server


def check_redis(queue, url: str) -> None:
    """Fail with a message now when the Redis queue does not answer."""
    import redis

    try:
        queue.r.ping()
    except redis.RedisError as exc:
        raise CotserveError(f"cannot reach Redis at {url}: {exc}") from exc


def set_threads(n: int | None) -> None:
    """torch's intra-op threads (None: torch's default)."""
    if n:
        import torch

        torch.set_num_threads(n)
