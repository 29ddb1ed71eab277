"""The FastAPI gateway: OpenAI-compatible chat completions in front of a `JobQueue`.

It validates and authenticates, applies the chat template (with the request's tools) and counts
prompt tokens, checks the per-request policy, enqueues a job, and turns the job's event stream
into an OpenAI response (one JSON body, or SSE chunks ending with `data: [DONE]`): reasoning split
(`reasoning.py`), tool calls parsed (`tools.py`), logprobs and n choices (`output.py`). Text
completions, /tokenize, /detokenize and /version live in `completions.py`. A client that goes
away cancels its job.

The routes here are thin: a request becomes a job in `jobs.py` (`JobFactory`), the job goes
through the queue in `relay.py` (`JobRelay`: readiness, enqueue, events, cancel), and its events
become the response in `responses.py`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cotserve import __version__
from cotserve.engine.textproc import encode_chat
from cotserve.errors import CotserveError
from cotserve.gateway import completions, errors
from cotserve.gateway.auth import check_key
from cotserve.gateway.errors import APIError
from cotserve.gateway.guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    Guard,
)
from cotserve.gateway.jobs import JobFactory
from cotserve.gateway.metrics import Metrics
from cotserve.gateway.output import TokenText
from cotserve.gateway.relay import JobRelay
from cotserve.gateway.request_id import RequestId, request_id_of
from cotserve.gateway.responses import chat_response, chat_stream
from cotserve.gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cotserve.gateway.tools import fallback_history, native_history, template_supports_tools
from cotserve.policies.options import typed_options
from cotserve.policies.served import ServedModel, check_served
from cotserve.queue.base import JobQueue

CHAT_PATH = "/v1/chat/completions"


class PromptBuilder:
    """Chat template + token counting, on the gateway side (the workers get token ids)."""

    def __init__(self, tokenizer, context_len: int, path: str | None = None, model: ServedModel | None = None):
        self.tokenizer = tokenizer
        self.context_len = int(context_len)
        self.path = path  # the model folder (generation_config.json), when known
        # the served model's shape and name, when known: per-request policy options are then
        # checked against it and the server's files at the gateway (`policies/served.py`)
        self.model = model
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
            if max_model_len > ctx:  # as vLLM refuses it: positions the model was not trained on
                raise CotserveError(f"--max-model-len {max_model_len} is beyond the model's {ctx} positions "
                                    "(max_position_embeddings)")
            ctx = max_model_len
        return cls(AutoTokenizer.from_pretrained(str(path)), ctx, str(path), ServedModel.from_config(spec, cfg))

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               prefix: str = "", template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids: the template over the history (tools natively or by the fallback), then
        `prefix` (a forced start of the reply) as plain text. `template_kwargs`: the request's
        chat_template_kwargs (extra template variables)."""
        if self.native_tools:
            ids = encode_chat(self.tokenizer, native_history(messages), tools, template_kwargs=template_kwargs)
        else:
            ids = encode_chat(self.tokenizer, fallback_history(messages, tools), template_kwargs=template_kwargs)
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
    keepalive_s: float = 0.0  # an SSE comment after this many seconds without an event (0: none)
    queue_outage_s: float = 30.0  # how long a request rides out an unreachable queue before it fails
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # header names and values together; more get 431
    max_headers: int = DEFAULT_MAX_HEADERS  # more headers get 431
    public_metrics: bool = False  # with API keys: /metrics and the API docs answer without a key too
    structured_outputs: bool = False  # the workers' engine constrains output (vLLM): response_format JSON modes etc.


def create_app(settings: GatewaySettings, queue: JobQueue, prompts: PromptBuilder) -> FastAPI:
    app = FastAPI(title="cotserve", version=__version__,
                  description="OpenAI-compatible chat completions with decode-time KV policies.")
    errors.install(app)
    metrics = Metrics(settings.model_name)
    app.state.metrics = metrics
    app.state.queue = queue
    app.state.settings = settings
    created = int(time.time())
    err_responses = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 431, 500, 503)}
    settings.policy_options = typed_options(settings.policy, settings.policy_options)
    if prompts.model is not None:  # the server's default policy must run on its model (CotserveError)
        check_served(settings.policy, settings.policy_options, prompts.model)
    jobs = JobFactory(settings, prompts)
    relay = JobRelay(settings, queue, metrics)
    token_text = TokenText(prompts.tokenizer)

    def count_status(path: str, status: int) -> None:
        if path.endswith("/chat/completions"):
            metrics.requests.labels(str(status)).inc()

    # with API keys, the API docs need one too unless they are public (/metrics: its route's dependency)
    key_paths = () if settings.public_metrics else tuple(
        p for p in (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if p)
    app.add_middleware(Guard, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes,
                       on_status=count_status, max_header_bytes=settings.max_header_bytes,
                       max_headers=settings.max_headers, key_paths=key_paths)
    app.add_middleware(RequestId)  # outermost: every answer, the Guard's too, carries X-Request-Id
    bearer = HTTPBearer(auto_error=False, description="An API key of the server (when it has keys).")

    async def auth(request: Request,
                   _credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not check_key(request.headers.get("authorization"), settings.api_keys):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    app.state.worker_alive = None  # `cotserve serve` without Redis: whether its worker thread still runs

    @app.get("/health", tags=["ops"], responses={503: {"model": ErrorResponse}})
    async def health() -> dict[str, str]:
        """The process is alive (and, without Redis, so is its worker thread)."""
        alive = app.state.worker_alive
        if alive is not None and not alive():
            raise APIError(503, "the worker thread stopped; the server log says why", code="worker_dead")
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"], responses={503: {"model": ErrorResponse}})
    async def ready():
        """A worker has its engine loaded and the queue answers."""
        ok, why, stats = await relay.readiness()
        alive = app.state.worker_alive
        if ok and alive is not None and not alive():
            ok, why = False, "the worker thread stopped; the server log says why"
        if not ok:
            raise APIError(503, why, code="not_ready", headers={"Retry-After": "1"})
        return {"status": "ready", **stats}

    metrics_key = [] if settings.public_metrics or not settings.api_keys else [Depends(auth)]

    @app.get("/metrics", tags=["ops"], response_class=Response, dependencies=metrics_key,
             responses={401: {"model": ErrorResponse}} if metrics_key else None)
    async def prom_metrics() -> Response:
        """Prometheus text format (with API keys: a key is needed, unless the server's metrics are public)."""
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
        job, plan = await jobs.chat_job(body)
        job.client_request_id = request_id_of(request)
        await relay.submit(job)
        if body.stream:
            metrics.requests.labels("200").inc()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = chat_stream(relay, job, plan, request, token_text, settings.model_name, include_usage)
            return SSEResponse(stream, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            result = await chat_response(relay, job, plan, request, token_text, settings.model_name)
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels("200").inc()
        return result

    completions.install(app, completions.Runtime(
        settings=settings, prompts=prompts, metrics=metrics, auth=auth, jobs=jobs, relay=relay,
        token_text=token_text, err_responses=err_responses, sse=SSEResponse))
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
