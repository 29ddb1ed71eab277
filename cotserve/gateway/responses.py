"""Job output to OpenAI response objects: usage, the `cotserve` telemetry object (shared by the chat
and text completion routes), chat completion bodies and SSE chunks, and a chat job run to its
response (`chat_response`, `chat_stream`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse

from cotserve.gateway.errors import APIError
from cotserve.gateway.output import ChatChoice, ChatPlan, TokenText, chat_logprobs
from cotserve.queue.base import Job

if TYPE_CHECKING:
    from cotserve.gateway.relay import JobRelay


def usage_of(dones: list[dict[str, Any]]) -> dict[str, int]:
    """OpenAI usage of a job's done events (one per choice; the prompt counted once)."""
    prompt = dones[0]["usage"]["prompt_tokens"]
    completion = sum(d["usage"]["completion_tokens"] for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def telemetry_of(dones: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's `cotserve` object: the first choice's telemetry, every choice's under
    `choices` when there are several."""
    tele = dict(dones[0].get("telemetry", {}))
    if len(dones) > 1:
        tele["choices"] = [d.get("telemetry", {}) for d in dones]
    return tele


def chat_completion(job: Job, model: str, choices: list[dict[str, Any]], dones: list[dict[str, Any]]
                    ) -> dict[str, Any]:
    """A whole `chat.completion` body."""
    return {"id": job.id, "object": "chat.completion", "created": int(job.created), "model": model,
            "choices": choices, "usage": usage_of(dones), "system_fingerprint": None,
            "cotserve": telemetry_of(dones)}


def chat_chunk(job: Job, model: str, delta: dict[str, Any], finish: str | None, include_usage: bool,
               extra: dict[str, Any] | None = None, index: int = 0, logprobs: dict[str, Any] | None = None) -> str:
    """One SSE event of a streamed chat completion: a `chat.completion.chunk` of one choice."""
    obj: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created),
                           "model": model, "system_fingerprint": None,
                           "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish}]}
    if include_usage:
        obj["usage"] = None
    if extra:
        obj.update(extra)
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def chat_usage_chunk(job: Job, model: str, dones: list[dict[str, Any]]) -> str:
    """The last SSE event of a streamed chat completion asked with include_usage: no choices, the usage."""
    obj = {"id": job.id, "object": "chat.completion.chunk", "created": int(job.created), "model": model,
           "system_fingerprint": None, "choices": [], "usage": usage_of(dones), "cotserve": telemetry_of(dones)}
    return f"data: {json.dumps(obj)}\n\n"


async def chat_response(relay: JobRelay, job: Job, plan: ChatPlan, request: Request, token_text: TokenText,
                        model: str) -> JSONResponse:
    """Run a chat job to its end: one `chat.completion` body."""
    choices = [ChatChoice(i, plan) for i in range(plan.n)]

    def on_event(ev: dict[str, Any]) -> None:
        c = choices[ev.get("i", 0)]
        if ev["t"] == "delta":
            c.add(ev)
        else:
            c.finish_reason = ev["finish_reason"]

    dones, _ = await relay.collect(job, request, plan.n, on_event)
    out = []
    for c in choices:
        message, finish = c.message()
        lp = chat_logprobs(token_text, c.ids, c.lps, plan.top_logprobs) if plan.logprobs else None
        out.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": lp})
    return JSONResponse(chat_completion(job, model, out, dones))


async def chat_stream(relay: JobRelay, job: Job, plan: ChatPlan, request: Request, token_text: TokenText,
                      model: str, include_usage: bool) -> AsyncIterator[str]:
    """Stream a chat job: SSE events of `chat.completion.chunk`s, then `data: [DONE]`."""

    def _chunk(delta: dict[str, Any], finish: str | None, extra: dict[str, Any] | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> str:
        return chat_chunk(job, model, delta, finish, include_usage, extra, index, logprobs)

    clock = relay.metrics.clock()
    choices = [ChatChoice(i, plan) for i in range(plan.n)]
    dones: list[dict[str, Any]] = []
    gen = relay.events(job, request, plan.n)
    announced: set[int] = set()  # choices whose role went out: with their first generated token
    try:
        async for ev in relay.guard(gen):
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
            if c.index not in announced:  # the first chunk carries the first generated token (TTFT)
                announced.add(c.index)
                if delta or lp:
                    delta = {"role": "assistant", **({"content": ""} if "content" not in delta else {}), **delta}
                else:
                    yield _chunk({"role": "assistant", "content": ""}, None, index=c.index)
            if delta or lp:
                yield _chunk(delta, None, index=c.index, logprobs=lp)
            if ev["t"] == "done":
                dones.append(ev)
                c.finish_reason = ev["finish_reason"]
                tele = ev.get("telemetry", {})
                relay.metrics.observe_done(ev["usage"], tele, ev.get("finish_reason"))
                yield _chunk({}, c.stream_finish_reason(), {"cotserve": tele}, index=c.index)
                if len(dones) == plan.n:
                    clock.finish()
                    if include_usage:
                        yield chat_usage_chunk(job, model, dones)
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()
        relay.metrics.in_flight.dec()
