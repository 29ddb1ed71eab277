"""Request and response bodies of the OpenAI-compatible API (pydantic; they make the OpenAPI spec).

Unknown request fields are ignored, as OpenAI's own server does for fields it does not know.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(description="Only 'text' parts are supported.")
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CotserveOptions(BaseModel):
    """Per-request policy (sent as `extra_body={"cotserve": {...}}` from the openai SDK)."""

    model_config = ConfigDict(extra="forbid")
    policy: str | None = Field(None, description="Policy or stack, e.g. 'sfi' or 'skipkv+sfi'. Default: the server's.")
    options: dict[str, Any] = Field(default_factory=dict, description="Policy options, e.g. {'k': 1024}.")


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens when both are given.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="Extension (as in vLLM): 0 = no top-k cut.")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension (as in vLLM): keep generating past end-of-sequence.")
    cotserve: CotserveOptions | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None


class Choice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


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
