"""The gateway's settings (`GatewaySettings`: what `cotserve serve` and its flags set), read by the
app and by the modules that turn requests into jobs and jobs into responses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cotserve.gateway.guard import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS


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
