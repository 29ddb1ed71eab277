"""Text completions and token utilities: `/v1/completions`, `/tokenize`, `/detokenize`, `/version`.

`/v1/completions` takes one raw prompt (a string or token ids; no chat template, no reasoning
split) and returns OpenAI's legacy `text_completion` object, whole or as SSE chunks. Supported:
max_tokens (default: the rest of the context), temperature, top_p, top_k, min_p, seed, stop,
stop_token_ids, min_tokens, presence/frequency/repetition penalties, logit_bias, n, logprobs
(0..20, OpenAI's legacy form), stream with include_usage, ignore_eos, priority and the `cotserve` policy
object. Not supported, with a 400 naming the field: echo, suffix, best_of other than n, a priority
beyond +-10000, response_format other than text, structured_outputs / guided_*, chat_template_kwargs,
several prompts in one request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from cotserve import __version__
from cotserve.errors import redact_paths
from cotserve.gateway.errors import APIError
from cotserve.gateway.jobs import JobFactory, refuse_unserved, template_kwargs
from cotserve.gateway.metrics import Metrics
from cotserve.gateway.output import TokenText, completion_logprobs
from cotserve.gateway.relay import JobRelay
from cotserve.gateway.request_id import request_id_of
from cotserve.gateway.responses import telemetry_of, usage_of
from cotserve.gateway.schemas import CompletionRequest, DetokenizeRequest, TokenizeRequest

COMPLETIONS_PATH = "/v1/completions"


@dataclass
class Runtime:
    """What the routes here share with the chat route (built in `app.create_app`)."""

    settings: Any
    prompts: Any
    metrics: Metrics
    auth: Callable
    jobs: JobFactory  # request -> job
    relay: JobRelay  # job <-> queue
    token_text: TokenText
    err_responses: dict
    sse: type  # the SSE response class


def prompt_ids(req: CompletionRequest, tokenizer) -> list[int]:
    """The one prompt's token ids (a string is tokenized with the tokenizer's special tokens)."""
    p: Any = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"one prompt per request is supported; got {len(p)}", param="prompt",
                           code="invalid_value")
        p = p[0]
    if isinstance(p, str):
        return list(tokenizer.encode(p))
    vocab = len(tokenizer)
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt",
                       code="invalid_value")
    return list(p)


def install(app: FastAPI, rt: Runtime) -> None:
    settings, prompts, metrics = rt.settings, rt.prompts, rt.metrics
    tok = prompts.tokenizer

    @app.get("/version", tags=["ops"])
    async def version() -> dict[str, Any]:
        """The server's version and what it serves."""
        return {"version": __version__, "model": settings.model_name, "max_model_len": prompts.context_len,
                "tool_call_parser": settings.tool_call_parser, "reasoning_parser": settings.reasoning_parser,
                "sampling_defaults": {"temperature": settings.default_temperature, "top_p": settings.default_top_p,
                                      "top_k": settings.default_top_k, "max_tokens": settings.default_max_tokens}}

    @app.post("/tokenize", dependencies=[Depends(rt.auth)], responses=rt.err_responses)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a raw `prompt`, or of chat `messages` through the chat template (as vLLM)."""
        rt.jobs.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt", code="invalid_value")
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            from cotserve.engine.textproc import encode_chat
            from cotserve.gateway.tools import fallback_history, native_history

            msgs = [m.model_dump(exclude_none=True) for m in body.messages or []]
            for m in msgs:
                if isinstance(m.get("content"), list):
                    m["content"] = "\n".join(part.get("text") or "" for part in m["content"])
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            kwargs = template_kwargs(body.chat_template_kwargs)
            try:
                if prompts.native_tools:
                    ids = encode_chat(tok, native_history(msgs), tools, body.add_generation_prompt, kwargs)
                else:
                    ids = encode_chat(tok, fallback_history(msgs, tools), None, body.add_generation_prompt, kwargs)
            except Exception as exc:
                raise APIError(400, f"cannot apply the chat template: {redact_paths(str(exc))}", param="messages") from exc
        out: dict[str, Any] = {"count": len(ids), "max_model_len": prompts.context_len, "tokens": list(ids)}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(list(ids))
        return out

    @app.post("/detokenize", dependencies=[Depends(rt.auth)], responses=rt.err_responses)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """Text of token ids."""
        rt.jobs.check_model(body.model)
        vocab = len(tok)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens",
                           code="invalid_value")
        return {"prompt": tok.decode(body.tokens)}

    @app.post(COMPLETIONS_PATH, dependencies=[Depends(rt.auth)],
              responses={**rt.err_responses, 200: {"content": {"text/event-stream": {}},
                                                   "description": "JSON, or SSE chunks when stream is true"}})
    async def completion(body: CompletionRequest, request: Request):
        rt.jobs.check_model(body.model)
        for name, bad in (("echo", body.echo), ("suffix", body.suffix),
                          ("tools", body.tools is not None), ("tool_choice", body.tool_choice is not None),
                          ("chat_template_kwargs", body.chat_template_kwargs is not None)):
            if bad:
                where = (" on /v1/completions (it works on /v1/chat/completions)"
                         if name.startswith(("tool", "chat_template")) else "")
                raise APIError(400, f"{name} is not supported{where}", param=name, code="invalid_value")
        refuse_unserved(body)
        ids = prompt_ids(body, tok)
        policy, options = rt.jobs.policy_of(body.cotserve)
        sampling = rt.jobs.sampling_of(body, len(ids), body.max_tokens, "max_tokens", body.logprobs, "prompt")
        job = rt.jobs.new_job(ids, sampling, policy, options, prefix="cmpl-", priority=body.priority)
        job.client_request_id = request_id_of(request)
        n = sampling["n"]
        await rt.relay.submit(job)
        if body.stream:
            metrics.requests.labels("200").inc()
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return rt.sse(_stream(job, request, n, body.logprobs, include_usage), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            texts = [""] * n
            ids_out: list[list[int]] = [[] for _ in range(n)]
            lps: list[list[Any]] = [[] for _ in range(n)]
            finish: list[str] = [""] * n

            def on_event(ev: dict[str, Any]) -> None:
                i = ev.get("i", 0)
                if ev["t"] == "delta":
                    texts[i] += ev.get("text", "")
                    ids_out[i].extend(ev.get("ids", []))
                    lps[i].extend(ev.get("lp", []))
                else:
                    finish[i] = ev["finish_reason"]

            dones, _ = await rt.relay.collect(job, request, n, on_event)
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels("200").inc()
        choices = [{"index": i, "text": texts[i], "finish_reason": finish[i],
                    "logprobs": completion_logprobs(rt.token_text, ids_out[i], lps[i])
                    if body.logprobs is not None else None} for i in range(n)]
        return JSONResponse({"id": job.id, "object": "text_completion", "created": int(job.created),
                             "model": settings.model_name, "choices": choices, "usage": usage_of(dones),
                             "system_fingerprint": None, "cotserve": telemetry_of(dones)})

    def _chunk(job, index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None,
               extra: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {"id": job.id, "object": "text_completion", "created": int(job.created),
                               "model": settings.model_name, "system_fingerprint": None,
                               "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}]}
        if extra:
            obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _stream(job, request: Request, n: int, logprobs: int | None, include_usage: bool):
        clock = metrics.clock()
        dones: list[dict[str, Any]] = []
        offsets = [0] * n
        gen = rt.relay.events(job, request, n)
        try:
            async for ev in rt.relay.guard(gen):
                if ev["t"] == "ping":
                    yield ": keep-alive\n\n"
                    continue
                if ev["t"] == "error":
                    err = APIError(int(ev.get("status", 500)), ev.get("message", "worker error"), code=ev.get("code"))
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                i = ev.get("i", 0)
                if ev["t"] == "delta":
                    clock.tokens(i, len(ev.get("ids") or ()))
                    lp = None
                    if logprobs is not None and ev.get("lp"):
                        lp = completion_logprobs(rt.token_text, ev["ids"], ev["lp"], offsets[i])
                    offsets[i] += len(ev.get("text", ""))
                    if ev.get("text") or lp:
                        yield _chunk(job, i, ev.get("text", ""), None, lp)
                    continue
                dones.append(ev)
                tele = ev.get("telemetry", {})
                metrics.observe_done(ev["usage"], tele, ev.get("finish_reason"))
                yield _chunk(job, i, "", ev["finish_reason"], None, {"cotserve": tele})
                if len(dones) == n:
                    clock.finish()
                    if include_usage:
                        obj = {"id": job.id, "object": "text_completion", "created": int(job.created),
                               "model": settings.model_name, "choices": [], "usage": usage_of(dones),
                               "cotserve": telemetry_of(dones)}
                        yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()
            metrics.in_flight.dec()
