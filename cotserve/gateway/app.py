"""The FastAPI gateway: OpenAI-compatible chat completions in front of a `JobQueue`.

It validates and authenticates, applies the chat template and counts prompt tokens, checks the
per-request policy, enqueues a job, and turns the job's event stream into an OpenAI response
(one JSON body, or SSE chunks ending with `data: [DONE]`). A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cotserve import __version__
from cotserve.engine.textproc import ReasoningStream, encode_chat, split_reasoning
from cotserve.errors import CotserveError
from cotserve.gateway import errors
from cotserve.gateway.auth import check_key
from cotserve.gateway.errors import APIError
from cotserve.gateway.metrics import Metrics
from cotserve.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cotserve.policies.registry import build_policy, server_only_keys
from cotserve.queue.base import Job, JobQueue, QueueFull, QueueUnavailable

CHAT_PATH = "/v1/chat/completions"


class PromptBuilder:
    """Chat template + token counting, on the gateway side (the workers get token ids)."""

    def __init__(self, tokenizer, context_len: int):
        self.tokenizer = tokenizer
        self.context_len = int(context_len)

    @classmethod
    def from_model(cls, spec: str | None) -> PromptBuilder:
        from transformers import AutoConfig, AutoTokenizer

        from cotserve.models import resolve_model

        path = resolve_model(spec)
        cfg = AutoConfig.from_pretrained(str(path))
        return cls(AutoTokenizer.from_pretrained(str(path)), getattr(cfg, "max_position_embeddings", 1 << 20))

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, messages)


@dataclass
class GatewaySettings:
    model_name: str
    policy: str = "dense"
    policy_options: dict[str, Any] = field(default_factory=dict)
    api_keys: list[str] = field(default_factory=list)
    max_pending: int = 256
    default_max_tokens: int = 1024
    default_temperature: float = 1.0
    poll_s: float = 0.5  # how often a waiting request checks for a client disconnect
    queue_timeout: float | None = None  # seconds a job may wait for a worker before it fails with 503


def _messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    out = []
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
        out.append({"role": role, "content": content})
    return out


def create_app(settings: GatewaySettings, queue: JobQueue, prompts: PromptBuilder) -> FastAPI:
    app = FastAPI(title="cotserve", version=__version__,
                  description="OpenAI-compatible chat completions with decode-time KV policies.")
    errors.install(app)
    metrics = Metrics()
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.settings = settings
    created = int(time.time())
    err_responses = {s: {"model": ErrorResponse} for s in (400, 401, 404, 429, 503)}

    async def auth(request: Request) -> None:
        if not check_key(request.headers.get("authorization"), settings.api_keys):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

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
              responses={**err_responses, 200: {"content": {"text/event-stream": {}},
                                                "description": "JSON, or SSE chunks when stream is true"}})
    async def chat(body: ChatCompletionRequest, request: Request):
        # error statuses are counted by the exception handlers (errors.install)
        job = await _make_job(body)
        await request_ready()
        try:
            await queue.submit(job, settings.max_pending)
        except QueueFull as exc:
            raise APIError(429, "the queue is full; retry later", code="queue_full",
                           headers={"Retry-After": str(max(1, int(exc.retry_after)))}) from exc
        except QueueUnavailable as exc:
            raise APIError(503, str(exc), code="queue_unavailable", headers={"Retry-After": "1"}) from exc
        metrics.in_flight.inc()
        if body.stream:
            metrics.requests.labels("200").inc()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(_stream(job, request, include_usage), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await _collect(job, request)
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels("200").inc()
        return result

    async def _make_job(body: ChatCompletionRequest) -> Job:
        if body.model != settings.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
        messages = _messages(body)
        policy, options = settings.policy, dict(settings.policy_options)
        if body.cotserve is not None:
            if body.cotserve.policy is not None:
                policy, options = body.cotserve.policy, {}
            forbidden = server_only_keys(body.cotserve.options)
            if forbidden:
                raise APIError(400, f"option(s) {', '.join(forbidden)} name server files and can only be set "
                               "by the server (serve --policy-opt / --policy-file)",
                               param="cotserve.options", code="invalid_policy")
            options.update(body.cotserve.options)
            try:
                build_policy(policy)
            except CotserveError as exc:
                raise APIError(400, str(exc), param="cotserve.policy", code="invalid_policy") from exc
            try:
                build_policy(policy, options)
            except CotserveError as exc:
                raise APIError(400, str(exc), param="cotserve.options", code="invalid_policy") from exc
        try:
            ids = await run_in_threadpool(prompts.encode, messages)
        except Exception as exc:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        ctx = prompts.context_len
        if not ids:
            raise APIError(400, "the prompt is empty", param="messages", code="invalid_value")
        if len(ids) >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the messages have "
                                f"{len(ids)} tokens.", param="messages", code="context_length_exceeded")
        asked = body.max_completion_tokens or body.max_tokens
        if asked is not None and len(ids) + asked > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{len(ids) + asked} tokens ({len(ids)} in the messages, {asked} in the completion).",
                           param="max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
                           code="context_length_exceeded")
        max_tokens = asked or min(settings.default_max_tokens, ctx - len(ids))
        temperature = settings.default_temperature if body.temperature is None else body.temperature
        seed = body.seed
        if seed is None and temperature > 0:
            seed = secrets.randbits(62)  # server-drawn: a retry on another worker can resume the stream
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": body.top_p or 1.0,
                    "top_k": body.top_k or 0, "seed": seed, "stop": stop, "ignore_eos": body.ignore_eos}
        job = Job(prompt_ids=ids, sampling=sampling, policy=policy, options=options)
        if settings.queue_timeout:
            job.deadline = job.created + settings.queue_timeout
        return job

    async def _events(job: Job, request: Request):
        """The job's events; cancels it when the client goes away (shielded: also on cancellation)."""
        after = "0"
        finished = False
        last_check = time.monotonic()
        try:
            while True:
                try:
                    evs = await queue.read(job.id, after, settings.poll_s)
                except QueueUnavailable as exc:
                    raise APIError(503, str(exc), code="queue_unavailable") from exc
                for eid, ev in evs:
                    after = eid
                    if ev.get("t") in ("done", "error"):
                        finished = True
                    yield ev
                    if finished:
                        return
                now = time.monotonic()
                if not evs or now - last_check >= settings.poll_s:
                    last_check = now
                    if await request.is_disconnected():
                        return
        finally:
            if not finished:
                await asyncio.shield(_cancel(job.id))

    async def _cancel(job_id: str) -> None:
        metrics.cancelled.inc()
        await queue.cancel(job_id)

    async def _collect(job: Job, request: Request) -> JSONResponse:
        t0 = time.perf_counter()
        text = ""
        done = None
        gen = _events(job, request)
        try:
            async for ev in gen:
                if ev["t"] == "delta":
                    text += ev["text"]
                elif ev["t"] == "error":
                    raise APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                elif ev["t"] == "done":
                    done = ev
        finally:
            await gen.aclose()
        if done is None:  # the client went away; nobody reads this
            raise APIError(499, "the client disconnected; the request was cancelled", code="cancelled",
                           type_="invalid_request_error")
        latency = time.perf_counter() - t0
        metrics.latency.observe(latency)
        metrics.ttft.observe(latency)
        metrics.observe_done(done["usage"], done.get("telemetry", {}))
        reasoning, content = split_reasoning(text)
        usage = done["usage"]
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return JSONResponse({
            "id": job.id, "object": "chat.completion", "created": int(job.created), "model": settings.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": done["finish_reason"], "logprobs": None}],
            "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            "system_fingerprint": None,
            "cotserve": done.get("telemetry", {}),
        })

    def _chunk(job: Job, delta: dict[str, Any], finish: str | None, include_usage: bool,
               extra: dict[str, Any] | None = None) -> str:
        import json

        obj: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created),
                               "model": settings.model_name, "system_fingerprint": None,
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            obj["usage"] = None
        if extra:
            obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _guard(gen):
        """Turn a backend failure mid-stream into an in-stream error event."""
        try:
            async for ev in gen:
                yield ev
        except APIError as exc:
            yield {"t": "error", "status": exc.status, "code": exc.code, "message": exc.message}

    async def _stream(job: Job, request: Request, include_usage: bool):
        import json

        t0 = time.perf_counter()
        first = True
        rs = ReasoningStream()
        gen = _events(job, request)
        try:
            yield _chunk(job, {"role": "assistant", "content": ""}, None, include_usage)
            async for ev in _guard(gen):
                if ev["t"] == "delta":
                    reasoning, content = rs.feed(ev["text"])
                elif ev["t"] == "done":
                    reasoning, content = rs.finish()
                else:  # error: OpenAI's in-stream error object, then the end marker
                    err = APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                if reasoning or content:
                    if first:
                        metrics.ttft.observe(time.perf_counter() - t0)
                        first = False
                    delta: dict[str, Any] = {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                    if content:
                        delta["content"] = content
                    yield _chunk(job, delta, None, include_usage)
                if ev["t"] == "done":
                    usage = dict(ev["usage"])
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    tele = ev.get("telemetry", {})
                    metrics.latency.observe(time.perf_counter() - t0)
                    metrics.observe_done(ev["usage"], tele)
                    yield _chunk(job, {}, ev["finish_reason"], include_usage, {"cotserve": tele})
                    if include_usage:
                        yield (f"data: {json.dumps({'id': job.id, 'object': 'chat.completion.chunk', 'created': int(job.created), 'model': settings.model_name, 'system_fingerprint': None, 'choices': [], 'usage': usage, 'cotserve': tele})}\n\n")
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()
            metrics.in_flight.dec()

    return app


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
