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
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cotserve import __version__
from cotserve.gateway import completions, errors
from cotserve.gateway.auth import check_key
from cotserve.gateway.errors import APIError
from cotserve.gateway.guard import (
    Guard,
)
from cotserve.gateway.jobs import JobFactory
from cotserve.gateway.metrics import Metrics
from cotserve.gateway.output import TokenText
from cotserve.gateway.prompts import PromptBuilder
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
from cotserve.gateway.settings import GatewaySettings
from cotserve.policies.options import typed_options
from cotserve.policies.served import check_served
from cotserve.queue.base import JobQueue

CHAT_PATH = "/v1/chat/completions"


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
