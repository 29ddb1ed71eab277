"""The FastAPI gateway: OpenAI-compatible chat completions in front of a `JobQueue`.

It validates and authenticates, applies the chat template (with the request's tools) and counts
prompt tokens, checks the per-request policy, enqueues a job, and turns the job's event stream
into an OpenAI response (one JSON body, or SSE chunks ending with `data: [DONE]`): reasoning split
(`reasoning.py`), tool calls parsed (`tools.py`), logprobs and n choices (`output.py`). Text
completions, /tokenize, /detokenize and /version live in `completions.py`. A client that goes
away cancels its job.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from cotserve import __version__
from cotserve.engine.textproc import encode_chat
from cotserve.errors import CotserveError
from cotserve.gateway import completions, errors
from cotserve.gateway.auth import check_key
from cotserve.gateway.errors import APIError
from cotserve.gateway.guard import DEFAULT_MAX_BODY_BYTES, Guard
from cotserve.gateway.metrics import Metrics
from cotserve.gateway.output import ChatChoice, ChatPlan, TokenText, chat_logprobs
from cotserve.gateway.reasoning import make_reasoning_parser
from cotserve.gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cotserve.gateway.tools import fallback_history, get_tool_parser, native_history, template_supports_tools
from cotserve.policies.options import OptionError, server_only_keys, typed_options, validate_spec
from cotserve.queue.base import Job, JobQueue, QueueFull, QueueUnavailable

CHAT_PATH = "/v1/chat/completions"


class PromptBuilder:
    """Chat template + token counting, on the gateway side (the workers get token ids)."""

    def __init__(self, tokenizer, context_len: int, path: str | None = None):
        self.tokenizer = tokenizer
        self.context_len = int(context_len)
        self.path = path  # the model folder (generation_config.json), when known
        self.native_tools = template_supports_tools(tokenizer)

    @classmethod
    def from_model(cls, spec: str | None, max_model_len: int | None = None) -> PromptBuilder:
        from transformers import AutoConfig, AutoTokenizer

        from cotserve.models import resolve_model

        path = resolve_model(spec)
        cfg = AutoConfig.from_pretrained(str(path))
        ctx = getattr(cfg, "max_position_embeddings", 1 << 20)
        if max_model_len is not None:
            if max_model_len < 2:
                raise CotserveError("--max-model-len must be at least 2")
            ctx = min(ctx, max_model_len)
        return cls(AutoTokenizer.from_pretrained(str(path)), ctx, str(path))

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               prefix: str = "") -> list[int]:
        """Prompt ids: the template over the history (tools natively or by the fallback), then
        `prefix` (a forced start of the reply) as plain text."""
        if self.native_tools:
            ids = encode_chat(self.tokenizer, native_history(messages), tools)
        else:
            ids = encode_chat(self.tokenizer, fallback_history(messages, tools))
        if prefix:
            ids = ids + self.tokenizer.encode(prefix, add_special_tokens=False)
        return ids


@dataclass
class GatewaySettings:
    model_name: str
    policy: str = "dense"
    policy_options: dict[str, Any] = field(default_factory=dict)
    api_keys: list[str] = field(default_factory=list)
    max_pending: int = 256
    default_max_tokens: int | None = None  # None: what remains of the context
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None  # a name from reasoning.REASONING_PARSERS, or None
    max_n: int = 16
    poll_s: float = 0.5  # how often a waiting request checks for a client disconnect
    queue_timeout: float | None = None  # seconds a job may wait for a worker before it fails with 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    keepalive_s: float = 15.0  # an SSE comment after this many seconds without an event
    queue_outage_s: float = 30.0  # how long a request rides out an unreachable queue before it fails


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type {part.type!r} is not supported; only text parts are",
                                   param=f"messages[{i}].content[{j}].type", code="invalid_value")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        out.append(msg)
    return out


def _tool_plan(req: ChatCompletionRequest, parser_name: str) -> tuple[list[dict[str, Any]] | None, ChatPlan]:
    """The tools to render and how to parse the reply, from `tools` and `tool_choice`."""
    plan = ChatPlan()
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None, plan
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", param="tools", code="invalid_value")
    if choice == "none":
        return None, plan
    parser = get_tool_parser(parser_name)
    plan.tools, plan.tool_names = parser, set(names)
    plan.parallel_tool_calls = req.parallel_tool_calls
    if choice == "required":
        plan.call_prefix = parser.call_prefix(None)
    elif choice not in (None, "auto"):
        name = choice.function.name
        if name not in plan.tool_names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice", code="invalid_value")
        plan.call_prefix = parser.call_prefix(name)
    return tools, plan


def create_app(settings: GatewaySettings, queue: JobQueue, prompts: PromptBuilder) -> FastAPI:
    app = FastAPI(title="cotserve", version=__version__,
                  description="OpenAI-compatible chat completions with decode-time KV policies.")
    errors.install(app)
    metrics = Metrics(settings.model_name)
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.settings = settings
    created = int(time.time())
    err_responses = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 500, 503)}
    settings.policy_options = typed_options(settings.policy, settings.policy_options)

    def count_status(path: str, status: int) -> None:
        if path.endswith("/chat/completions"):
            metrics.requests.labels(str(status)).inc()

    app.add_middleware(Guard, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                       on_status=count_status)
    bearer = HTTPBearer(auto_error=False, description="An API key of the server (when it has keys).")

    async def auth(request: Request,
                   _credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not check_key(request.headers.get("authorization"), settings.api_keys):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    last_ready = [0.0]

    async def request_ready() -> None:
        """503 unless ready; a positive answer is trusted for a second (saves queue round trips)."""
        if time.monotonic() - last_ready[0] < 1.0:
            return
        ok, why, _ = await readiness()
        if not ok:
            raise APIError(503, why, code="not_ready", headers={"Retry-After": "1"})
        last_ready[0] = time.monotonic()

    async def readiness() -> tuple[bool, str, dict[str, int]]:
        try:
            if not await queue.ping():
                return False, "the queue backend does not answer", {}
            stats = await queue.stats()
        except Exception as exc:
            return False, f"the queue backend does not answer: {type(exc).__name__}", {}
        if stats.get("workers", 0) < 1:
            return False, "no worker is ready (the model may still be loading)", stats
        return True, "ready", stats

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"], responses={503: {"model": ErrorResponse}})
    async def ready():
        """A worker has its engine loaded and the queue answers."""
        ok, why, stats = await readiness()
        if not ok:
            raise APIError(503, why, code="not_ready", headers={"Retry-After": "1"})
        return {"status": "ready", **stats}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def prom_metrics() -> Response:
        """Prometheus text format."""
        try:
            stats = await queue.stats()
        except Exception:
            stats = {}
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(auth)], responses={401: {"model": ErrorResponse}})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=created, max_model_len=prompts.context_len)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[Depends(auth)],
             responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def model(model_id: str) -> ModelCard:
        if model_id != settings.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return ModelCard(id=settings.model_name, created=created, max_model_len=prompts.context_len)

    @app.post(CHAT_PATH, response_model=ChatCompletion, dependencies=[Depends(auth)],
              responses={**err_responses, 200: {"content": {"text/event-stream": {"schema": SSE_CHUNK_EVENT}},
                  "description": "JSON, or SSE chunks when stream is true: each `data:` line a "
                                 "ChatCompletionChunk, then `data: [DONE]`"}})
    async def chat(body: ChatCompletionRequest, request: Request):
        # error statuses are counted by the exception handlers (errors.install)
        job, plan = await _make_job(body)
        await submit(job)
        if body.stream:
            metrics.requests.labels("200").inc()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(_stream(job, plan, request, include_usage), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await _collect(job, plan, request)
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels("200").inc()
        return result

    async def submit(job: Job) -> None:
        """Readiness check, then enqueue (429 when the queue is full); counts the request in flight."""
        await request_ready()
        try:
            await queue.submit(job, settings.max_pending)
        except QueueFull as exc:
            raise APIError(429, "the queue is full; retry later", code="queue_full",
                           headers={"Retry-After": str(max(1, int(exc.retry_after)))}) from exc
        except QueueUnavailable as exc:
            raise APIError(503, str(exc), code="queue_unavailable", headers={"Retry-After": "1"}) from exc
        metrics.in_flight.inc()

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")

    def policy_of(cot) -> tuple[str, dict[str, Any]]:
        policy, options = settings.policy, dict(settings.policy_options)
        if cot is not None:
            if cot.policy is not None:
                policy, options = cot.policy, {}
            forbidden = server_only_keys(cot.options)
            if forbidden:
                raise APIError(400, f"option(s) {', '.join(forbidden)} name server files and can only be set "
                               "by the server (serve --policy-opt / --policy-file)",
                               param=f"cotserve.options.{forbidden[0]}", code="invalid_policy")
            options.update(cot.options)
            try:  # the typed option models: no torch, no files (the worker checks those)
                validate_spec(policy, options)
            except OptionError as exc:
                raise APIError(400, str(exc), param=exc.param, code="invalid_policy") from exc
        return policy, options

    def sampling_of(body, n_prompt: int, asked: int | None, asked_param: str, logprobs: int | None,
                    where: str) -> dict[str, Any]:
        """Sampling settings: the request's, else the defaults (generation config, server)."""
        ctx = prompts.context_len
        if not n_prompt:
            raise APIError(400, "the prompt is empty", param=where, code="invalid_value")
        if n_prompt >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the {where} have "
                                f"{n_prompt} tokens.", param=where, code="context_length_exceeded")
        if asked is not None and n_prompt + asked > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{n_prompt + asked} tokens ({n_prompt} in the {where}, {asked} in the completion).",
                           param=asked_param, code="context_length_exceeded")
        n = body.n or 1
        if n > settings.max_n:
            raise APIError(400, f"n is at most {settings.max_n} on this server", param="n", code="invalid_value")
        room = ctx - n_prompt
        max_tokens = asked or (min(settings.default_max_tokens, room) if settings.default_max_tokens else room)
        temperature = settings.default_temperature if body.temperature is None else body.temperature
        seed = body.seed
        if seed is None and temperature > 0:
            seed = secrets.randbits(62)  # server-drawn: a retry on another worker can resume the stream
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return {"max_tokens": max_tokens, "temperature": temperature,
                "top_p": settings.default_top_p if body.top_p is None else body.top_p,
                "top_k": settings.default_top_k if body.top_k is None else body.top_k, "seed": seed, "stop": stop,
                "ignore_eos": body.ignore_eos, "logprobs": logprobs, "n": n}

    def new_job(ids: list[int], sampling: dict[str, Any], policy: str, options: dict[str, Any],
                prefix: str = "chatcmpl-") -> Job:
        job = Job(prompt_ids=ids, sampling=sampling, policy=policy, options=options)
        job.id = prefix + job.id.partition("-")[2]
        if settings.queue_timeout:
            job.deadline = job.created + settings.queue_timeout
        return job

    async def _make_job(body: ChatCompletionRequest) -> tuple[Job, ChatPlan]:
        check_model(body.model)
        for name, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is deprecated and not supported; send {new}", param=name,
                               code="invalid_value")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        messages = _messages(body)
        tools, plan = _tool_plan(body, settings.tool_call_parser)
        plan.n = body.n or 1
        plan.reasoning = make_reasoning_parser(settings.reasoning_parser)
        plan.logprobs, plan.top_logprobs = body.logprobs, body.top_logprobs or 0
        policy, options = policy_of(body.cotserve)
        try:
            ids = await run_in_threadpool(prompts.encode, messages, tools, plan.call_prefix)
        except Exception as exc:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        asked = body.max_completion_tokens or body.max_tokens
        sampling = sampling_of(body, len(ids), asked,
                               "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
                               plan.top_logprobs if body.logprobs else None, "messages")
        return new_job(ids, sampling, policy, options), plan

    async def events(job: Job, request: Request, n: int = 1):
        """The job's events until its n sequences are done (or an error); cancels the job when the
        client goes away (shielded: also on cancellation).

        While nothing arrives it yields {"t": "ping"} every `keepalive_s` (streams send an SSE
        comment), ends with a 503 `queue_timeout` once the job has waited `queue_timeout` seconds
        without a worker (queued, or handed back after its worker was lost), and rides out an
        unreachable queue for `queue_outage_s` seconds, retrying with backoff."""
        after = "0"
        finished = False
        done = 0
        start = time.monotonic()
        last_check = last_event = last_state = start
        pending_since: float | None = start
        outage_since: float | None = None
        try:
            while True:
                try:
                    evs = await queue.read(job.id, after, settings.poll_s)
                    outage_since = None
                except QueueUnavailable as exc:
                    now = time.monotonic()
                    outage_since = outage_since or now
                    if now - outage_since >= settings.queue_outage_s:
                        raise APIError(503, f"the queue has been unreachable for {now - outage_since:.0f} s",
                                       code="queue_unavailable") from exc
                    await asyncio.sleep(min(1.0, 0.05 + (now - outage_since) / 4))
                    evs = []
                for eid, ev in evs:
                    after = eid
                    if ev.get("t") == "done":
                        done += 1
                    if ev.get("t") == "error" or done >= n:
                        finished = True
                    yield ev
                    if finished:
                        return
                now = time.monotonic()
                if evs:
                    last_event, pending_since = now, None
                else:
                    if now - last_event >= settings.keepalive_s:
                        last_event = now
                        yield {"t": "ping"}
                    if outage_since is None and now - last_state >= 1.0:
                        last_state = now
                        pending_since = await job_waits(job, pending_since, now)
                if not evs or now - last_check >= settings.poll_s:
                    last_check = now
                    if await request.is_disconnected():
                        return
        finally:
            if not finished:
                await asyncio.shield(_cancel(job.id))

    async def job_waits(job: Job, pending_since: float | None, now: float) -> float | None:
        """Since when the job has been waiting without a worker (None while one runs it); raises
        the request's error once that is longer than the queue timeout, or when the queue lost the job."""
        try:
            state = await queue.state(job.id)
        except QueueUnavailable:
            return pending_since
        if state is None:
            raise APIError(503, "the queue lost this request (its backend restarted without its data); retry",
                           code="job_lost", headers={"Retry-After": "1"})
        if state != "pending":
            return None
        since = pending_since if pending_since is not None else now
        if settings.queue_timeout and now - since >= settings.queue_timeout:
            raise APIError(503, f"no worker took this request for {now - since:.0f} s (the server's "
                                "--queue-timeout); retry later", code="queue_timeout", headers={"Retry-After": "1"})
        return since

    async def _cancel(job_id: str) -> None:
        metrics.cancelled.inc()
        await queue.cancel(job_id)

    async def collect(job: Job, request: Request, n: int, on_event) -> tuple[list[dict[str, Any]], float]:
        """Run a job to its end, handing each delta/done event to `on_event`; returns the done
        events (by choice index) and the latency."""
        clock = metrics.clock()
        dones: list[dict[str, Any] | None] = [None] * n
        gen = events(job, request, n)
        try:
            async for ev in gen:
                if ev["t"] == "ping":
                    continue
                if ev["t"] == "error":
                    raise APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                on_event(ev)
                if ev["t"] == "delta":
                    clock.tokens(ev.get("i", 0), len(ev.get("ids") or ()))
                if ev["t"] == "done":
                    dones[ev.get("i", 0)] = ev
        finally:
            await gen.aclose()
        if any(d is None for d in dones):  # the client went away; nobody reads this
            raise APIError(499, "the client disconnected; the request was cancelled", code="cancelled",
                           type_="invalid_request_error")
        latency = clock.finish()
        for d in dones:
            metrics.observe_done(d["usage"], d.get("telemetry", {}), d.get("finish_reason"))
        return dones, latency

    def usage_of(dones: list[dict[str, Any]]) -> dict[str, int]:
        prompt = dones[0]["usage"]["prompt_tokens"]
        completion = sum(d["usage"]["completion_tokens"] for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def telemetry_of(dones: list[dict[str, Any]]) -> dict[str, Any]:
        tele = dict(dones[0].get("telemetry", {}))
        if len(dones) > 1:
            tele["choices"] = [d.get("telemetry", {}) for d in dones]
        return tele

    async def _collect(job: Job, plan: ChatPlan, request: Request) -> JSONResponse:
        choices = [ChatChoice(i, plan) for i in range(plan.n)]

        def on_event(ev: dict[str, Any]) -> None:
            c = choices[ev.get("i", 0)]
            if ev["t"] == "delta":
                c.add(ev)
            else:
                c.finish_reason = ev["finish_reason"]

        dones, _ = await collect(job, request, plan.n, on_event)
        out = []
        for c in choices:
            message, finish = c.message()
            lp = chat_logprobs(token_text, c.ids, c.lps, plan.top_logprobs) if plan.logprobs else None
            out.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": lp})
        return JSONResponse({
            "id": job.id, "object": "chat.completion", "created": int(job.created), "model": settings.model_name,
            "choices": out, "usage": usage_of(dones), "system_fingerprint": None, "cotserve": telemetry_of(dones),
        })

    def _chunk(job: Job, delta: dict[str, Any], finish: str | None, include_usage: bool,
               extra: dict[str, Any] | None = None, index: int = 0, logprobs: dict[str, Any] | None = None) -> str:
        import json

        obj: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created),
                               "model": settings.model_name, "system_fingerprint": None,
                               "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        if extra:
            obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def guard(gen):
        """Turn a backend failure mid-stream into an in-stream error event."""
        try:
            async for ev in gen:
                yield ev
        except APIError as exc:
            yield {"t": "error", "status": exc.status, "code": exc.code, "message": exc.message}

    async def _stream(job: Job, plan: ChatPlan, request: Request, include_usage: bool):
        import json

        clock = metrics.clock()
        choices = [ChatChoice(i, plan) for i in range(plan.n)]
        dones: list[dict[str, Any]] = []
        gen = events(job, request, plan.n)
        try:
            for c in choices:
                yield _chunk(job, {"role": "assistant", "content": ""}, None, include_usage, index=c.index)
            async for ev in guard(gen):
                if ev["t"] == "ping":
                    yield ": keep-alive\n\n"
                    continue
                if ev["t"] == "error":  # OpenAI's in-stream error object, then the end marker
                    err = APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                c = choices[ev.get("i", 0)]
                if ev["t"] == "delta":
                    clock.tokens(c.index, len(ev.get("ids") or ()))
                delta = c.feed(ev["text"]) if ev["t"] == "delta" else c.finish()
                lp = None
                if plan.logprobs and ev.get("lp"):
                    lp = chat_logprobs(token_text, ev["ids"], ev["lp"], plan.top_logprobs)
                if delta or lp:
                    yield _chunk(job, delta, None, include_usage, index=c.index, logprobs=lp)
                if ev["t"] == "done":
                    dones.append(ev)
                    c.finish_reason = ev["finish_reason"]
                    tele = ev.get("telemetry", {})
                    metrics.observe_done(ev["usage"], tele, ev.get("finish_reason"))
                    yield _chunk(job, {}, c.stream_finish_reason(), include_usage, {"cotserve": tele}, index=c.index)
                    if len(dones) == plan.n:
                        clock.finish()
                        if include_usage:
                            usage = usage_of(dones)
                            yield (f"data: {json.dumps({'id': job.id, 'object': 'chat.completion.chunk', 'created': int(job.created), 'model': settings.model_name, 'system_fingerprint': None, 'choices': [], 'usage': usage, 'cotserve': telemetry_of(dones)})}\n\n")
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()
            metrics.in_flight.dec()

    token_text = TokenText(prompts.tokenizer)
    completions.install(app, completions.Runtime(
        settings=settings, prompts=prompts, metrics=metrics, auth=auth, submit=submit, check_model=check_model,
        policy_of=policy_of, sampling_of=sampling_of, new_job=new_job, collect=collect, events=events,
        guard=guard, usage_of=usage_of, telemetry_of=telemetry_of, token_text=token_text,
        err_responses=err_responses, sse=SSEResponse))
    install_openapi(app)
    return app


# One event of a streamed chat completion, as OpenAPI 3.1 describes an event stream (its `schema`
# is one event): `data` is a ChatCompletionChunk as JSON, an error object as JSON (a failure after
# the stream began), or the closing `[DONE]`.
SSE_CHUNK_EVENT: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "data": {"oneOf": [
        {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": "#/components/schemas/ChatCompletionChunk"}, {"$ref": "#/components/schemas/ErrorResponse"}]}},
        {"const": "[DONE]"}]}},
}


def install_openapi(app: FastAPI) -> None:
    """The OpenAPI document as served: no 422 (validation errors are 400 in OpenAI's shape), the
    streamed chunk schema among the components."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        for item in schema.get("paths", {}).values():
            for op in item.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        comps.update(ChatCompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
                     .pop("$defs", {}))
        comps["ChatCompletionChunk"] = {k: v for k, v in ChatCompletionChunk.model_json_schema(
            ref_template="#/components/schemas/{model}").items() if k != "$defs"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class SSEResponse(StreamingResponse):
    """Closes the event generator when the client goes away mid-stream, so its job is cancelled now
    (not whenever the garbage collector finalizes the generator)."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await asyncio.shield(aclose())
