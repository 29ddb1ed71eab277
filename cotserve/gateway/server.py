"""`cotserve serve` and `cotserve worker`: wiring of gateway, queue, worker and engine.

Without a Redis URL, `serve` runs everything in one process: the gateway, an in-process queue
and one worker thread that loads the model in the background (/ready turns 200 once it has).
With `--redis-url`, `serve` is a gateway only (it loads just the tokenizer) and `cotserve worker`
processes, as many as wanted, do the decoding.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import CotserveError
from cotserve.gateway.auth import check_bind, load_keys

log = logging.getLogger("cotserve.serve")


@dataclass
class EngineArgs:
    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 8
    max_wait: float = 0.02
    threads: int | None = None
    engine: str = "native"  # native | vllm
    vllm_options: dict[str, Any] = field(default_factory=dict)  # VLLMOptions fields (--engine vllm)
    scheduler: str = "continuous"  # continuous | static (worker_continuous.make_worker)
    prefill_chunk: int = 256  # continuous: prompt tokens prefilled per engine step


def make_engine(engine_args: EngineArgs):
    """The worker's engine: cotserve's native engine, or vLLM with the cotserve plugin."""
    if engine_args.engine == "vllm":
        from cotserve.vllm.engine import VLLMEngine, VLLMOptions

        return VLLMEngine(engine_args.model, device=engine_args.device, dtype=engine_args.dtype,
                          max_batch=engine_args.max_batch, options=VLLMOptions(**engine_args.vllm_options))
    if engine_args.engine != "native":
        raise CotserveError(f"unknown engine {engine_args.engine!r} (native or vllm)")
    from cotserve.engine.native import NativeEngine
    from cotserve.models import load_model

    return NativeEngine(load_model(engine_args.model, device=engine_args.device, dtype=engine_args.dtype),
                        max_batch=engine_args.max_batch)


@dataclass
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "dense"
    policy_options: dict[str, Any] = field(default_factory=dict)
    redis_url: str | None = None
    key_prefix: str = "cotserve:"
    api_key_file: str | None = None
    insecure: bool = False
    max_pending: int = 256
    default_max_tokens: int | None = None  # None: what remains of the context
    default_temperature: float = 1.0
    generation_config: str = "auto"  # auto | vllm | PATH (gateway/defaults.py)
    max_model_len: int | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str = "auto"
    served_model_name: str | None = None
    queue_timeout: float | None = 300.0  # None: no limit
    max_body_bytes: int = 4 * 1024 * 1024
    keepalive_s: float = 15.0
    queue_outage_s: float = 30.0
    log_level: str = "info"


def start_worker_thread(engine_args: EngineArgs, queue, worker_id: str = "embedded") -> threading.Thread:
    """Load the model and serve `queue` from a daemon thread (the embedded default)."""

    def run() -> None:
        from cotserve.worker_continuous import make_worker

        try:
            engine = make_engine(engine_args)
        except CotserveError as exc:
            log.error("the worker cannot load its model: %s", exc)
            return
        make_worker(engine, queue, engine_args.scheduler, engine_args.prefill_chunk, worker_id=worker_id,
                    max_batch=engine_args.max_batch, max_wait=engine_args.max_wait).run()

    t = threading.Thread(target=run, name="cotserve-worker", daemon=True)
    t.start()
    return t


def gateway_settings(args: ServeArgs, engine_args: EngineArgs, prompts, keys: list[str] | None = None):
    """The gateway's settings from the serve options and the model: the sampling defaults of
    `--generation-config`, the tool call and reasoning parsers."""
    from cotserve.gateway.app import GatewaySettings
    from cotserve.gateway.defaults import SamplingDefaults, load_defaults
    from cotserve.gateway.reasoning import resolve_reasoning_parser
    from cotserve.gateway.tools import get_tool_parser
    from cotserve.model_names import model_slug

    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise CotserveError("--default-max-tokens must be at least 1")
    get_tool_parser(args.tool_call_parser)  # fail now on an unknown name
    tpl = getattr(prompts.tokenizer, "chat_template", None)
    reasoning = resolve_reasoning_parser(args.reasoning_parser, tpl if isinstance(tpl, str) else None)
    base = SamplingDefaults(temperature=args.default_temperature, max_tokens=args.default_max_tokens)
    defaults = load_defaults(args.generation_config, prompts.path, base)
    if defaults.max_tokens is not None and args.default_max_tokens is not None:
        defaults.max_tokens = args.default_max_tokens  # the command line wins over the model's file
    return GatewaySettings(
        model_name=args.served_model_name or model_slug(engine_args.model), policy=args.policy,
        policy_options=args.policy_options, api_keys=keys or [], max_pending=args.max_pending,
        default_max_tokens=defaults.max_tokens, default_temperature=defaults.temperature,
        default_top_p=defaults.top_p, default_top_k=defaults.top_k, tool_call_parser=args.tool_call_parser,
        reasoning_parser=reasoning, queue_timeout=args.queue_timeout, max_body_bytes=args.max_body_bytes,
        keepalive_s=args.keepalive_s, queue_outage_s=args.queue_outage_s)


def run_serve(args: ServeArgs, engine_args: EngineArgs) -> None:
    import uvicorn

    from cotserve.gateway.app import PromptBuilder, create_app
    from cotserve.policies.registry import build_policy
    from cotserve.queue import make_queue

    keys = load_keys(args.api_key_file)
    check_bind(args.host, keys, args.insecure)
    build_policy(args.policy, args.policy_options)  # fail now, not on every request
    _set_threads(engine_args.threads)
    prompts = PromptBuilder.from_model(engine_args.model, args.max_model_len)
    settings = gateway_settings(args, engine_args, prompts, keys)
    queue = make_queue(args.redis_url, prefix=args.key_prefix)
    if args.redis_url:
        _check_redis(queue, args.redis_url)
    app = create_app(settings, queue, prompts)
    if not args.redis_url:
        start_worker_thread(engine_args, queue)
    # log_config=None: uvicorn's records go through the handler cotserve.logconfig installed
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                timeout_graceful_shutdown=5)


def run_worker(redis_url: str, key_prefix: str, engine_args: EngineArgs, worker_id: str | None = None,
               heartbeat_s: float = 1.0) -> None:
    import signal

    from cotserve.queue import make_queue
    from cotserve.worker_continuous import make_worker

    _set_threads(engine_args.threads)
    queue = make_queue(redis_url, prefix=key_prefix)
    _check_redis(queue, redis_url)
    engine = make_engine(engine_args)
    worker = make_worker(engine, queue, engine_args.scheduler, engine_args.prefill_chunk, worker_id=worker_id,
                         max_batch=engine_args.max_batch, max_wait=engine_args.max_wait, heartbeat_s=heartbeat_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    log.info("worker %s serving %s from %s (prefix %r)", worker.worker_id, engine_args.model, redis_url, key_prefix)
    worker.run()


def _check_redis(queue, url: str) -> None:
    import redis

    try:
        queue.r.ping()
    except redis.RedisError as exc:
        raise CotserveError(f"cannot reach Redis at {url}: {exc}") from exc


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """A uvicorn server for `app` on a thread of this process (tests, notebooks).

    `with ServerThread(app) as url: ...` serves on a free loopback port until the block ends."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                                   timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        import time

        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise CotserveError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
