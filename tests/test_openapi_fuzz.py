"""Schemathesis over the served `/openapi.json`: generated requests against the embedded gateway
(a real worker on the bundled model, an API key that the calls send) get no 5xx, and every response matches the document
(status code, content type, headers and body schema), and a wrong key gets 401. Not checked:
that every schema-valid body is accepted; the server refuses some combinations the document
cannot express (a prompt and messages together, top_logprobs without logprobs) with a documented
400. Bounded: a few examples per operation, a
timeout per call, and at most two tokens and two choices per generated completion."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import positive_data_acceptance  # noqa: E402
from test_gateway import MODEL, Embedded, wait_for  # noqa: E402

KEY = "sk-fuzz-key"
CAPS = {"max_tokens": 2, "max_completion_tokens": 2, "n": 2, "top_logprobs": 2}


def test_a_number_without_fraction_is_an_integer_as_the_document_says():
    """JSON Schema's "integer" holds 5.0; strings, booleans and fractions stay refused."""
    from pydantic import ValidationError

    from cotserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest

    msg = [{"role": "user", "content": "x"}]
    req = ChatCompletionRequest(model="m", messages=msg, max_tokens=5.0, n=1.0, seed=-3.0, top_logprobs=2.0)
    assert (req.max_tokens, req.n, req.seed, req.top_logprobs) == (5, 1, -3, 2) and type(req.max_tokens) is int
    assert CompletionRequest(model="m", prompt=[[1.0, 2]]).prompt == [[1, 2]]
    assert DetokenizeRequest(tokens=[3.0]).tokens == [3]
    for bad in ("5", True, 5.5, float("inf")):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=msg, max_tokens=bad)


def _bounded(case) -> None:
    """At most two tokens and two choices, whatever was generated."""
    if not isinstance(case.body, dict):
        return
    if isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # the served model's name, so generated requests reach the worker
    seed = case.body.get("seed")
    if type(seed) in (int, float) and float(seed).is_integer():
        # the generator handles bounds beyond 2**53 through floats: its "-2**63" is -9223372036854776000,
        # outside the document's range; clamp to the bounds it meant
        case.body["seed"] = max(-(2**63), min(2**64 - 1, int(seed)))
    for key, cap in CAPS.items():
        value = case.body.get(key)
        if type(value) is int and value > cap:
            case.body[key] = cap
    if case.path == "/v1/chat/completions" and "max_tokens" not in case.body:
        case.body.setdefault("max_completion_tokens", 2)


def test_generated_requests_get_no_5xx_and_match_the_served_schema(engine):
    with Embedded(engine, queue_timeout=30.0, api_keys=[KEY]) as s:
        wait_for(lambda: httpx.get(s.url + "/ready").status_code == 200, what="ready")
        # with API keys the document needs one too (`--public-metrics` makes it public)
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/models", "/ready", "/health"}
        calls: dict[str, int] = {}
        statuses: dict[str, set[int]] = {}
        failures = []
        for op in operations:
            try:
                _checker(op, calls, statuses)()
            except Exception as exc:  # every operation runs; the failures are listed together
                failures.append(f"{op.label}: {exc}")
        assert not failures, "\n\n".join(failures)
        assert all(calls.get(op.label) for op in operations), calls
        # a streamed answer (text/event-stream, its schema a $ref to ChatCompletionChunk) passes the checks too
        chat = schema["/v1/chat/completions"]["POST"]
        case = chat.Case(body={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                               "stream": True, "stream_options": {"include_usage": True}})
        response = case.call_and_validate(timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
        assert response.text.rstrip().endswith("data: [DONE]")
        assert 200 in statuses["POST /v1/chat/completions"], statuses  # some reached the worker and back


def _checker(op, calls: dict[str, int], statuses: dict[str, set[int]]):
    @given(case=op.as_strategy())
    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case):
        _bounded(case)
        calls[op.label] = calls.get(op.label, 0) + 1
        response = case.call_and_validate(timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                                          excluded_checks=[positive_data_acceptance])
        statuses.setdefault(op.label, set()).add(response.status_code)

    return check
