"""Request and response bodies of the OpenAI-compatible API (pydantic; they make the OpenAPI spec).

Unknown request fields are ignored, as OpenAI's own server does for fields it does not know.
Booleans and integers are taken as JSON gives them: `"stream": "yes"`, `"ignore_eos": 0` or
`"max_tokens": "5"` are refused (400), as OpenAI refuses them. A number with no fraction
(`"max_tokens": 5.0`) is an integer, as JSON Schema counts it (the OpenAPI document says "integer").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 5 and 5.0 (and lists of them), not "5", true or 5.5."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(description="Only 'text' parts are supported.")
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (as OpenAI sends it) or an object.")


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message (conversation history)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="Assistant messages: the calls it made.")
    tool_call_id: str | None = Field(None, description="Tool messages: the call this result answers.")
    reasoning_content: str | None = Field(None, description="Ignored in history (templates drop past reasoning).")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="'json_object' and 'json_schema' ({name, schema}) constrain the output on --engine vllm "
                    "(vLLM's structured outputs); the native engine refuses them (400).")
    json_schema: dict[str, Any] | None = None


class SamplingFields(BaseModel):
    """Sampling and decoding fields shared by chat and text completions (OpenAI's and vLLM's)."""

    model_config = ConfigDict(extra="ignore")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Minus this for each token already "
                                           "generated (once per distinct token).")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Minus this times the count of each "
                                            "token in the generated text.")
    repetition_penalty: float | None = Field(None, gt=0, description="Extension (as in vLLM): logits of "
                                             "prompt and generated tokens divided (when positive) or multiplied "
                                             "by it; 1 = off.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension (as in vLLM): drop tokens less likely "
                                "than min_p times the most likely one.")
    min_tokens: StrictInt | None = Field(None, ge=0, description="Extension (as in vLLM): no end-of-sequence or "
                                         "stop_token_ids before this many tokens.")
    stop_token_ids: list[StrictInt] | None = Field(None, description="Extension (as in vLLM): token ids that end "
                                                   "the completion.")
    thinking_token_budget: StrictInt | None = Field(None, ge=0, description="Extension (as in vLLM): at most this "
                                                    "many tokens inside <think>, then </think> is forced and the "
                                                    "answer follows; for models with <think> tokens (else 400).")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100] "
                                                "added to its logit.")
    response_format: ResponseFormat | None = Field(None, description="JSON modes: honoured on --engine vllm, "
                                                   "refused (400) on the native engine.")
    best_of: StrictInt | None = Field(None, ge=1, description="Only equal to n (or null); more is refused (400).")
    priority: StrictInt | None = Field(None, description="Extension (as in vLLM): lower is served earlier (the "
                                       "queue claims by priority, then arrival; on --engine vllm started with "
                                       "scheduling_policy=priority, vLLM's scheduler takes it too). Within "
                                       "+-10000; default 0.")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM's structured outputs: one of json, "
                                                      "json_object, regex, choice, grammar; honoured on --engine "
                                                      "vllm, refused (400) on the native engine.")
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's older form of structured_outputs.json "
                                                     "(as structured_outputs).")
    guided_regex: str | None = Field(None, description="As structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="As structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="As structured_outputs.grammar.")

    _sampling_integers = field_validator("min_tokens", "stop_token_ids", "best_of", "priority",
                                         "thinking_token_budget", mode="before")(_integral)


class CotserveOptions(BaseModel):
    """Per-request policy (sent as `extra_body={"cotserve": {...}}` from the openai SDK)."""

    model_config = ConfigDict(extra="forbid")
    policy: str | None = Field(None, description="Policy or stack, e.g. 'sfi' or 'skipkv+sfi'. Default: the server's.")
    options: dict[str, Any] = Field(default_factory=dict, description="Policy options, e.g. {'k': 1024}.")


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="Wins over max_tokens when both are given.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0, description="Extension (as in vLLM): 0 = no top-k cut.")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(1, ge=1, description="Choices to generate from the one prompt (they share its prefill).")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: StrictBool = Field(False, description="Extension (as in vLLM): keep generating past end-of-sequence.")
    logprobs: StrictBool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Also the k most likely tokens (needs logprobs).")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' when tools are given, else 'none'.")
    parallel_tool_calls: StrictBool = True
    functions: list[dict[str, Any]] | None = Field(None, description="OpenAI's deprecated form of tools: refused "
                                                   "(400); send tools.")
    function_call: str | dict[str, Any] | None = Field(None, description="Deprecated: refused (400); send "
                                                       "tool_choice.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extension (as in vLLM): extra "
                                                        "variables of the chat template, e.g. {'enable_thinking': "
                                                        "false}.")
    cotserve: CotserveOptions | None = None

    _integers = field_validator("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "top_logprobs", mode="before")(_integral)


class CompletionRequest(SamplingFields):
    """Legacy text completions: a raw prompt, no chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        description="One prompt: a string or token ids (a list holding one of them is accepted too).")
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0, description="Extension (as in vLLM): 0 = no top-k cut.")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    echo: StrictBool = Field(False, description="Not supported (true is refused).")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Top log-probabilities per token (0..20).")
    suffix: str | None = Field(None, description="Not supported.")
    user: str | None = None
    ignore_eos: StrictBool = False
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported on text completions: refused (400); "
                                               "tools work on /v1/chat/completions.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Refused (400), as tools.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Refused (400): text completions apply "
                                                        "no chat template.")
    cotserve: CotserveOptions | None = None

    _integers = field_validator("prompt", "max_tokens", "top_k", "seed", "n", "logprobs", mode="before")(_integral)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a raw `prompt`, or chat `messages` rendered through the template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages: extra variables of the "
                                                        "chat template.")
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]

    _integers = field_validator("tokens", mode="before")(_integral)


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="The reasoning (litellm's name), with a reasoning parser.")
    reasoning: str | None = Field(None, description="The same text under vLLM's current name.")
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    cotserve: dict[str, Any] = Field(default_factory=dict, description="This request's policy telemetry.")


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` line of a streamed chat completion (the stream ends with `data: [DONE]`; an error
    mid-stream is one `data:` line holding an ErrorResponse, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    cotserve: dict[str, Any] | None = Field(None, description="Telemetry, on each choice's last chunk.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cotserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
