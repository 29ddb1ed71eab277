"""Request to job: a chat or text completion request becomes a queue `Job` (prompt ids, sampling
settings, policy spec and options) or a 4xx `APIError` naming the field at fault.

`JobFactory` holds what the translation needs from the server (its settings and the prompt
builder); the routes (`app.py`, `completions.py`) call it and hand the job to the queue.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from cotserve.errors import redact_paths
from cotserve.gateway.errors import APIError
from cotserve.gateway.output import ChatPlan
from cotserve.gateway.reasoning import make_reasoning_parser
from cotserve.gateway.schemas import ChatCompletionRequest
from cotserve.gateway.tools import get_tool_parser
from cotserve.policies.options import OptionError, server_only_keys, validate_spec
from cotserve.policies.served import check_served
from cotserve.queue.base import PRIORITY_LIMIT, Job
from cotserve.structured import STRUCTURED_KINDS

if TYPE_CHECKING:
    from cotserve.gateway.prompts import PromptBuilder
    from cotserve.gateway.settings import GatewaySettings


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
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


def tool_plan(req: ChatCompletionRequest, parser_name: str) -> tuple[list[dict[str, Any]] | None, ChatPlan]:
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


STRUCTURED = "structured decoding (JSON, regex, choice or grammar constrained output) is not implemented on the native engine"
# chat_template_kwargs that would replace the server's own arguments of apply_chat_template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
    "return_tensors", "add_generation_prompt", "continue_final_message", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask"})


def structured_of(body, served: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The request's constrained-output spec as vLLM's structured outputs take it ({kind: value}) and
    the field that asked for it, or (None, None). `served` False (the native engine): a 400 naming
    the field, so a request for JSON is never answered with free text."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                           param="response_format", code="invalid_value")
        asked.append(("response_format", {"json": schema}))
    if body.structured_outputs is not None:
        spec = {k: v for k, v in body.structured_outputs.items() if v is not None and v is not False}
        kinds = [k for k in spec if k in STRUCTURED_KINDS]
        if len(kinds) != 1 or len(spec) != 1:
            raise APIError(400, f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}",
                           param="structured_outputs", code="invalid_value")
        asked.append(("structured_outputs", spec))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            asked.append((name, {kind: getattr(body, name)}))
    if not asked:
        return None, None
    name, spec = asked[0]
    if not served:
        raise APIError(400, f"{name} is not supported on this server's engine: {STRUCTURED}; serve with "
                       "--engine vllm for it", param=name, code="invalid_value")
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]} and {name} both constrain the output; give one",
                       param=asked[1][0], code="invalid_value")
    return spec, name


def refuse_unserved(body) -> None:
    """400 naming the first field asked for that this server does not do: best_of other than n, a
    priority beyond +-PRIORITY_LIMIT (constrained output: `structured_of`)."""
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of is not supported beyond n (give best_of equal to n, or leave it out)",
                       param="best_of", code="invalid_value")
    if body.priority is not None and abs(body.priority) > PRIORITY_LIMIT:
        raise APIError(400, f"priority must be within +-{PRIORITY_LIMIT} (lower is served earlier)",
                       param="priority", code="invalid_value")


def template_kwargs(value: dict[str, Any] | None) -> dict[str, Any]:
    """The request's chat_template_kwargs, with the server's own arguments refused."""
    kwargs = dict(value or {})
    bad = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise APIError(400, f"chat_template_kwargs cannot set {bad[0]!r} (the server sets it)",
                       param=f"chat_template_kwargs.{bad[0]}", code="invalid_value")
    return kwargs


class JobFactory:
    """Turns requests into jobs for one server (`settings`, `prompts`)."""

    def __init__(self, settings: GatewaySettings, prompts: PromptBuilder):
        self.settings = settings
        self.prompts = prompts

    def check_model(self, name: str | None) -> None:
        settings = self.settings
        if name is not None and name != settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")

    def policy_of(self, cot) -> tuple[str, dict[str, Any]]:
        """The policy spec and options: the server's, else the request's `cotserve` object."""
        policy, options = self.settings.policy, dict(self.settings.policy_options)
        if cot is not None:
            if cot.policy is not None:
                policy, options = cot.policy, {}
            forbidden = server_only_keys(cot.options)
            if forbidden:
                raise APIError(400, f"option(s) {', '.join(forbidden)} name server files and can only be set "
                               "by the server (serve --policy-opt / --policy-file)",
                               param=f"cotserve.options.{forbidden[0]}", code="invalid_policy")
            options.update(cot.options)
            try:  # the typed option models, then the served model and the server's files (no torch)
                validate_spec(policy, options)
                if self.prompts.model is not None:
                    check_served(policy, options, self.prompts.model)
            except OptionError as exc:
                raise APIError(400, redact_paths(str(exc)), param=exc.param, code="invalid_policy") from exc
        return policy, options

    def sampling_of(self, body, n_prompt: int, asked: int | None, asked_param: str, logprobs: int | None,
                    where: str) -> dict[str, Any]:
        """Sampling settings: the request's, else the defaults (generation config, server)."""
        settings = self.settings
        ctx = self.prompts.context_len
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
        seed, drawn = body.seed, False
        if seed is None and temperature > 0:
            seed, drawn = secrets.randbits(62), True  # server-drawn: a retry on another worker can resume the stream
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = {"max_tokens": max_tokens, "temperature": temperature,
               "top_p": settings.default_top_p if body.top_p is None else body.top_p,
               "top_k": settings.default_top_k if body.top_k is None else body.top_k, "seed": seed, "stop": stop,
               "ignore_eos": body.ignore_eos, "logprobs": logprobs, "n": n, **({"seed_drawn": True} if drawn else {})}
        out.update(self.decoding_of(body, max_tokens))
        return out

    def decoding_of(self, body, max_tokens: int) -> dict[str, Any]:
        """The request's penalties, min_p, min_tokens, thinking_token_budget, stop_token_ids and logit_bias, as job sampling
        settings (SamplingParams fields); only those that differ from the defaults, so a job
        without them is the same as before they existed."""
        vocab = len(self.prompts.tokenizer)
        out: dict[str, Any] = {}
        spec, field = structured_of(body, self.settings.structured_outputs)
        if spec is not None:
            out["structured"], out["structured_field"] = spec, field
        for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_p", 0.0)):
            value = getattr(body, name)
            if value is not None and value != default:
                out[name] = float(value)
        if body.min_tokens:
            if body.min_tokens > max_tokens:
                raise APIError(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})",
                               param="min_tokens", code="invalid_value")
            out["min_tokens"] = body.min_tokens
        if body.thinking_token_budget is not None:
            from cotserve.policies.steering import think_ids

            if None in think_ids(self.prompts.tokenizer):
                raise APIError(400, "thinking_token_budget needs a model with <think> and </think> tokens; this "
                               "model has none", param="thinking_token_budget", code="invalid_value")
            out["thinking_token_budget"] = body.thinking_token_budget
        if body.stop_token_ids:
            bad = [t for t in body.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               param="stop_token_ids", code="invalid_value")
            out["stop_token_ids"] = list(body.stop_token_ids)
        if body.logit_bias:
            bias: dict[str, float] = {}
            for key, value in body.logit_bias.items():
                try:
                    tid = int(key)
                except ValueError:
                    tid = -1
                if not 0 <= tid < vocab:
                    raise APIError(400, f"logit_bias key {key!r} is not a token id of the vocabulary "
                                   f"(0..{vocab - 1})", param="logit_bias", code="invalid_value")
                if not -100 <= value <= 100:
                    raise APIError(400, f"logit_bias of token {key} is {value}; biases are in [-100, 100]",
                                   param="logit_bias", code="invalid_value")
                if value:
                    bias[str(tid)] = float(value)
            if bias:
                out["logit_bias"] = bias
        return out

    def new_job(self, ids: list[int], sampling: dict[str, Any], policy: str, options: dict[str, Any],
                prefix: str = "chatcmpl-", priority: int | None = None) -> Job:
        priority = int(priority or 0)
        job = Job(prompt_ids=ids, sampling=sampling, policy=policy, options=options, priority=priority)
        job.id = prefix + job.id.partition("-")[2]
        if self.settings.queue_timeout:
            job.deadline = job.created + self.settings.queue_timeout
        return job

    async def chat_job(self, body: ChatCompletionRequest) -> tuple[Job, ChatPlan]:
        """The job of a chat completion request, and how to turn its output into choices."""
        settings = self.settings
        self.check_model(body.model)
        for name, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is deprecated and not supported; send {new}", param=name,
                               code="invalid_value")
        refuse_unserved(body)
        kwargs = template_kwargs(body.chat_template_kwargs)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        messages = chat_messages(body)
        tools, plan = tool_plan(body, settings.tool_call_parser)
        plan.n = body.n or 1
        plan.reasoning = make_reasoning_parser(settings.reasoning_parser)
        plan.logprobs, plan.top_logprobs = body.logprobs, body.top_logprobs or 0
        policy, options = self.policy_of(body.cotserve)
        try:
            ids = await run_in_threadpool(self.prompts.encode, messages, tools, plan.call_prefix, kwargs)
        except Exception as exc:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {redact_paths(str(exc))}", param="messages") from exc
        asked = body.max_completion_tokens or body.max_tokens
        sampling = self.sampling_of(body, len(ids), asked,
                                    "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens",
                                    plan.top_logprobs if body.logprobs else None, "messages")
        return self.new_job(ids, sampling, policy, options, priority=body.priority), plan
