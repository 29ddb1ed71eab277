"""`cotserve serve`: wiring of gateway, queue and, without Redis, the embedded worker.

Without a Redis URL, `serve` runs everything in one process: the gateway, an in-process queue
and one worker thread that loads the model in the background (/ready turns 200 once it has).
With `--redis-url`, `serve` is a gateway only (it loads just the tokenizer) and `cotserve worker`
processes (`cotserve/worker/main.py`), as many as wanted, do the decoding.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from cotserve.errors import CotserveError
from cotserve.gateway.auth import check_bind, load_keys
from cotserve.worker.main import EngineArgs, check_redis, set_threads, start_worker_thread

log = logging.getLogger("cotserve.serve")


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
    keepalive_s: float = 0.0
    queue_outage_s: float = 30.0
    drain_s: float = 120.0  # on SIGTERM: seconds running requests get to finish
    max_header_bytes: int = 64 * 1024  # a request with more header bytes, or more headers, gets 431
    max_headers: int = 256
    public_metrics: bool = False  # with API keys: /metrics and the API docs open without one
    log_level: str = "info"


def gateway_settings(args: ServeArgs, engine_args: EngineArgs, prompts, keys: list[str] | None = None):
    """The gateway's settings from the serve options and the model: the sampling defaults of
    `--generation-config`, the tool call and reasoning parsers."""
    from cotserve.gateway.defaults import SamplingDefaults, load_defaults
    from cotserve.gateway.reasoning import resolve_reasoning_parser
    from cotserve.gateway.settings import GatewaySettings
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
        keepalive_s=args.keepalive_s, queue_outage_s=args.queue_outage_s, max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers, public_metrics=args.public_metrics,
        structured_outputs=engine_args.engine == "vllm")


def run_serve(args: ServeArgs, engine_args: EngineArgs) -> None:
    """Serve until SIGTERM or SIGINT: then drain (streams get `drain_s` seconds), stop the
    worker and close its engine, and end every process the server started. A worker that cannot
    load its engine (or restart it after it died) ends the server with that reason."""
    import uvicorn

    from cotserve.gateway.app import PromptBuilder, create_app
    from cotserve.policies.registry import build_policy
    from cotserve.queue import make_queue

    keys = load_keys(args.api_key_file)
    check_bind(args.host, keys, args.insecure)
    build_policy(args.policy, args.policy_options)  # fail now, not on every request
    set_threads(engine_args.threads)
    prompts = PromptBuilder.from_model(engine_args.model, args.max_model_len)
    settings = gateway_settings(args, engine_args, prompts, keys)
    queue = make_queue(args.redis_url, prefix=args.key_prefix)
    if args.redis_url:
        check_redis(queue, args.redis_url)
    app = create_app(settings, queue, prompts)
    # log_config=None: uvicorn's records go through the handler cotserve.logconfig installed
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           log_config=None, timeout_graceful_shutdown=args.drain_s))
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    embedded = None
    if not args.redis_url:
        embedded = start_worker_thread(engine_args, queue, on_fatal=on_fatal)
        app.state.worker_alive = lambda: embedded.alive
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in place
    # that lands here, and the worker, its engine and their processes are stopped below first
    previous = _quiet_signals()
    try:
        server.run()
    finally:
        if embedded is not None:
            embedded.close(timeout=5.0)
        end_children(3.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if embedded is not None:
        # the engine and its processes are stopped; leave now rather than wait on what vLLM's
        # libraries still hold at interpreter exit (their own exit handlers can hang on a dead peer)
        _exit_now(2 if fatal else 0, fatal[0] if fatal else None)
    if fatal:
        raise CotserveError(fatal[0])


def _exit_now(code: int, message: str | None) -> None:
    import os
    import sys

    if message:
        print(f"error: {message}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _quiet_signals() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}


def end_children(grace_s: float) -> None:
    """Terminate the processes this one started that are still alive (vLLM's engine and workers
    when its own shutdown did not end them), then kill those that outlive `grace_s`."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for c in children:
        try:
            c.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for c in alive:
        log.warning("process %d outlived the shutdown; killing it", c.pid)
        try:
            c.kill()
        except psutil.Error:
            pass
