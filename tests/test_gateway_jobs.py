"""Request to job (`gateway.jobs.JobFactory`) and job output to response objects
(`gateway.responses`), without a queue or a model: the bundled tokenizer and chat template only."""

from __future__ import annotations

import asyncio
import json

import pytest

from cotserve.gateway.app import GatewaySettings, PromptBuilder
from cotserve.gateway.errors import APIError
from cotserve.gateway.jobs import JobFactory
from cotserve.gateway.responses import chat_chunk, chat_usage_chunk, telemetry_of, usage_of
from cotserve.gateway.schemas import ChatCompletionRequest, CompletionRequest


@pytest.fixture(scope="module")
def prompts():
    return PromptBuilder.from_model("smollm2-135m-instruct", max_model_len=64)


def _factory(prompts, **kw) -> JobFactory:
    return JobFactory(GatewaySettings(model_name="m", **kw), prompts)


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **kw)


def test_chat_job_carries_the_prompt_the_sampling_and_the_policy(prompts):
    jobs = _factory(prompts, policy="h2o", policy_options={"budget": 32}, default_temperature=0.0,
                    queue_timeout=5.0)
    job, plan = asyncio.run(jobs.chat_job(_chat(max_tokens=7, stop="\n", n=2)))
    assert job.prompt_ids == prompts.encode([{"role": "user", "content": "Hi"}])
    assert job.id.startswith("chatcmpl-") and job.deadline == job.created + 5.0
    assert (job.policy, job.options) == ("h2o", {"budget": 32})
    s = job.sampling
    assert (s["max_tokens"], s["temperature"], s["stop"], s["n"], s["seed"]) == (7, 0.0, ["\n"], 2, None)
    assert plan.n == 2
    # a sampled request without a seed gets one drawn by the server
    job, _ = asyncio.run(jobs.chat_job(_chat(temperature=0.7)))
    assert isinstance(job.sampling["seed"], int)
    assert job.sampling["max_tokens"] == 64 - len(job.prompt_ids)  # the rest of the context


@pytest.mark.parametrize("body,status,param", [
    (dict(model="other"), 404, "model"),
    (dict(max_tokens=1000), 400, "max_tokens"),
    (dict(max_completion_tokens=1000), 400, "max_completion_tokens"),
    (dict(n=99), 400, "n"),
    (dict(top_logprobs=3), 400, "top_logprobs"),
    (dict(functions=[{"name": "f"}]), 400, "functions"),
    (dict(cotserve={"policy": "nope"}), 400, None),
    (dict(cotserve={"options": {"vector": "/x"}}), 400, "cotserve.options.vector"),
])
def test_chat_job_refuses_with_the_field_at_fault(prompts, body, status, param):
    req = ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body})
    with pytest.raises(APIError) as err:
        asyncio.run(_factory(prompts).chat_job(req))
    assert err.value.status == status
    if param is not None:
        assert err.value.param == param


def test_text_completion_sampling_and_job_prefix(prompts):
    jobs = _factory(prompts, default_max_tokens=5)
    body = CompletionRequest(model="m", prompt="Hello")
    sampling = jobs.sampling_of(body, 3, None, "max_tokens", 2, "prompt")
    assert sampling["max_tokens"] == 5 and sampling["logprobs"] == 2
    assert jobs.new_job([1, 2, 3], sampling, "dense", {}, prefix="cmpl-").id.startswith("cmpl-")
    with pytest.raises(APIError, match="the prompt is empty"):
        jobs.sampling_of(body, 0, None, "max_tokens", None, "prompt")
    with pytest.raises(APIError, match="maximum context length is 64 tokens; the prompt have 64"):
        jobs.sampling_of(body, 64, None, "max_tokens", None, "prompt")


def test_usage_telemetry_and_chunks_of_done_events(prompts):
    dones = [{"usage": {"prompt_tokens": 4, "completion_tokens": 3}, "telemetry": {"policy": "dense", "a": 1}},
             {"usage": {"prompt_tokens": 4, "completion_tokens": 5}, "telemetry": {"policy": "dense", "a": 2}}]
    assert usage_of(dones) == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert telemetry_of(dones[:1]) == {"policy": "dense", "a": 1}
    assert telemetry_of(dones)["choices"] == [d["telemetry"] for d in dones]
    job = _factory(prompts).new_job([1], {}, "dense", {})
    chunk = chat_chunk(job, "m", {"content": "é"}, None, True, index=1)
    assert chunk.startswith("data: ") and chunk.endswith("\n\n") and "é" in chunk
    obj = json.loads(chunk[6:])
    assert obj["object"] == "chat.completion.chunk" and obj["usage"] is None
    assert obj["choices"] == [{"index": 1, "delta": {"content": "é"}, "logprobs": None, "finish_reason": None}]
    last = json.loads(chat_usage_chunk(job, "m", dones)[6:])
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 12
