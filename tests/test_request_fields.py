"""OpenAI / vLLM request fields a client relies on: each is honoured (penalties, min_p, min_tokens,
stop_token_ids, logit_bias, chat_template_kwargs; constrained output on the vLLM engine) or refused
with a 400 naming it (response_format JSON modes, structured_outputs and guided_* on the native
engine, best_of other than n, a priority beyond +-10000; priority orders the queue). The
native engine is driven over HTTP (gateway + in-process queue + worker thread); the sampler's
functions against hand computations; vLLM's side through the `SamplingParams` it is given."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import httpx
import pytest
import torch
from support import ServerThread

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    filter_min_p,
    process_logits,
    sample_next,
)
from cotserve.errors import RequestError
from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.queue import InProcessQueue
from cotserve.queue.base import Job
from cotserve.worker import Worker

MODEL = "smollm2-135m-instruct"
# the bundled model's template, plus a variable the way Qwen3's template reads enable_thinking
THINK_SWITCH = "{% if enable_thinking is defined and not enable_thinking %}{{ '/no_think\n' }}{% endif %}"
REPEAT = "the the the the the the the the"


@pytest.fixture(scope="module")
def srv(engine):
    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = tok.chat_template + THINK_SWITCH
    queue = InProcessQueue()
    app = create_app(GatewaySettings(model_name=MODEL), queue, PromptBuilder(tok, engine.info.max_positions))
    worker = Worker(engine, queue, worker_id="w-fields", max_batch=4)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    server = ServerThread(app)
    url = server.start()
    deadline = time.time() + 60
    while httpx.get(url + "/ready").status_code != 200:
        assert time.time() < deadline, "worker not ready"
        time.sleep(0.05)
    yield url
    server.stop()
    worker.stop()
    thread.join(timeout=60)


def complete(url: str, prompt, status: int = 200, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def chat(url: str, status: int = 200, **kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8,
            "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def ids_of(engine, prompt: list[int], **sampling) -> list[int]:
    (res,) = engine.generate([GenRequest(list(prompt), SamplingParams(**sampling))])
    return res.token_ids


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": "Name three colours."}])


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# -- defaults: the same tokens as before ----------------------------------------------------------
def test_defaults_leave_the_tokens_as_they_were(srv, engine, prompt):
    base = ids_of(engine, prompt, max_tokens=12)
    out = complete(srv, prompt, max_tokens=12)["choices"][0]["text"]
    assert out == engine.tokenizer.decode(base, skip_special_tokens=True)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
               "stop_token_ids": [], "logit_bias": {}, "best_of": 1, "priority": 0,
               "response_format": {"type": "text"}}
    assert complete(srv, prompt, max_tokens=12, **neutral)["choices"][0]["text"] == out
    row = torch.randn(50)
    assert process_logits(row, SamplingParams(), [1, 2], [3]) is row


# -- honoured on the output ----------------------------------------------------------------------
def test_logit_bias_removes_and_forces_tokens(srv, engine, prompt):
    tok = engine.tokenizer
    first = ids_of(engine, prompt, max_tokens=1)[0]
    out = complete(srv, prompt, max_tokens=1, logit_bias={str(first): -100})
    assert out["choices"][0]["text"] != tok.decode([first])
    assert ids_of(engine, prompt, max_tokens=1, logit_bias={first: -100})[0] != first
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    out = complete(srv, prompt, max_tokens=3, logit_bias={str(forced): 100})
    assert out["choices"][0]["text"] == tok.decode([forced] * 3)
    # sampled too: +100 leaves no other token any probability
    out = complete(srv, prompt, max_tokens=3, temperature=1.0, seed=3, logit_bias={str(forced): 100})
    assert out["choices"][0]["text"] == tok.decode([forced] * 3)


def test_min_tokens_holds_off_the_end(srv, engine, prompt):
    eos = engine.tokenizer.eos_token_id
    ends_at_once = {"logit_bias": {str(eos): 100}}
    out = complete(srv, prompt, max_tokens=16, **ends_at_once)
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "stop"
    out = complete(srv, prompt, max_tokens=16, min_tokens=5, **ends_at_once)
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "stop"
    # a stop token id is held off as well
    first = ids_of(engine, prompt, max_tokens=1)[0]
    assert complete(srv, prompt, stop_token_ids=[first])["usage"]["completion_tokens"] == 1
    assert complete(srv, prompt, stop_token_ids=[first], min_tokens=4)["usage"]["completion_tokens"] >= 4
    # on chat too
    out = chat(srv, max_tokens=16, min_tokens=5, **ends_at_once)
    assert out["usage"]["completion_tokens"] == 6


def test_stop_token_ids_end_at_that_token(srv, engine, prompt):
    base = ids_of(engine, prompt, max_tokens=12, ignore_eos=True)
    at = next(i for i in range(3, len(base)) if base[i] not in base[:i])
    out = complete(srv, prompt, max_tokens=12, stop_token_ids=[base[at]])
    assert out["usage"]["completion_tokens"] == at + 1 and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == engine.tokenizer.decode(base[:at], skip_special_tokens=True)
    assert chat(srv, max_tokens=12, stop_token_ids=[engine.tokenizer.eos_token_id])["choices"][0]["finish_reason"]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"repetition_penalty": 2.0}])
def test_penalties_lower_the_repeats(srv, engine, penalty):
    ids = engine.tokenizer.encode(REPEAT)
    base = ids_of(engine, ids, max_tokens=16, ignore_eos=True)
    assert repeats(base) >= 8  # the greedy output is repetitive
    out = complete(srv, ids, max_tokens=16, ignore_eos=True, **penalty)["choices"][0]["text"]
    assert out != engine.tokenizer.decode(base, skip_special_tokens=True)
    got = ids_of(engine, ids, max_tokens=16, ignore_eos=True, **{k: v for k, v in penalty.items()})
    assert engine.tokenizer.decode(got, skip_special_tokens=True) == out
    assert repeats(got) < repeats(base)


def test_min_p_one_is_greedy(srv, engine, prompt):
    greedy = complete(srv, prompt, max_tokens=10)["choices"][0]["text"]
    for seed in (1, 2):
        out = complete(srv, prompt, max_tokens=10, temperature=1.5, seed=seed, min_p=1.0)
        assert out["choices"][0]["text"] == greedy


def test_chat_template_kwargs_reach_the_template(srv):
    msgs = [{"role": "user", "content": "Hi"}]
    plain = httpx.post(srv + "/tokenize", json={"messages": msgs}).json()
    off = httpx.post(srv + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.status_code == 200, off.text
    assert off.json()["count"] > plain["count"]
    a = chat(srv, max_tokens=1, messages=msgs)["usage"]["prompt_tokens"]
    b = chat(srv, max_tokens=1, messages=msgs, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert (a, b) == (plain["count"], off.json()["count"])
    assert chat(srv, max_tokens=1, messages=msgs, chat_template_kwargs={"enable_thinking": True})["usage"][
        "prompt_tokens"] == a


# -- refused with a 400 naming the field ----------------------------------------------------------
REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"response_format": {"type": "regex"}}, "response_format.type"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "[0-9]+"}, "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"priority": 10**7}, "priority"),
    ({"priority": -10_001}, "priority"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


def _error(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["param"] == param, e
    return e


@pytest.mark.parametrize("patch,param", REFUSED)
def test_refused_on_chat(srv, patch, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **patch}
    e = _error(httpx.post(srv + "/v1/chat/completions", json=body, timeout=60), param)
    if param in ("response_format", "structured_outputs") or param.startswith("guided_"):
        assert "structured decoding" in e["message"] and "not implemented" in e["message"]


@pytest.mark.parametrize("patch,param", REFUSED)
def test_refused_on_completions(srv, patch, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, **patch}
    _error(httpx.post(srv + "/v1/completions", json=body, timeout=60), param)


@pytest.mark.parametrize("patch,param", [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
])
def test_chat_template_kwargs_refused(srv, patch, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **patch}
    _error(httpx.post(srv + "/v1/chat/completions", json=body, timeout=60), param)
    _error(httpx.post(srv + "/tokenize", json={"messages": body["messages"], **patch}, timeout=60), param)


def test_chat_template_kwargs_refused_on_completions(srv):
    body = {"model": MODEL, "prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}
    _error(httpx.post(srv + "/v1/completions", json=body, timeout=60), "chat_template_kwargs")


def test_best_of_equal_to_n_is_accepted(srv, prompt):
    assert chat(srv, max_tokens=2, n=2, best_of=2)["choices"][1]["index"] == 1
    assert complete(srv, prompt, max_tokens=2, best_of=1)["choices"]


def test_openapi_declares_the_fields(srv):
    comps = httpx.get(srv + "/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = comps[name]["properties"]
        for field in ("response_format", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "min_tokens", "min_p", "stop_token_ids", "best_of", "priority", "structured_outputs",
                      "guided_json", "guided_regex", "guided_choice", "guided_grammar", "chat_template_kwargs"):
            assert field in props, (name, field)
    assert "chat_template_kwargs" in comps["TokenizeRequest"]["properties"]


# -- the job carries them to the worker ----------------------------------------------------------
def test_the_job_carries_the_fields_through_json(srv, engine, prompt):
    from cotserve.gateway.jobs import JobFactory
    from cotserve.gateway.schemas import CompletionRequest

    factory = JobFactory(GatewaySettings(model_name=MODEL), PromptBuilder(engine.tokenizer, 2048))
    plain = factory.sampling_of(CompletionRequest(model=MODEL, prompt="x"), 3, 8, "max_tokens", None, "prompt")
    assert set(plain) == {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs",
                          "n", "seed_drawn"}
    req = CompletionRequest(model=MODEL, prompt="x", presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.3, min_p=0.1, min_tokens=2, stop_token_ids=[7],
                            logit_bias={"11": -100, "12": 0})
    sampling = factory.sampling_of(req, 3, 8, "max_tokens", None, "prompt")
    job = Job.from_json(Job(prompt_ids=[1, 2, 3], sampling=sampling).to_json())
    n = job.sampling.pop("n")
    params = SamplingParams(**job.sampling)
    assert n == 1
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
            params.min_tokens, params.stop_token_ids, params.logit_bias) == (0.5, 0.25, 1.3, 0.1, 2, [7], {11: -100.0})


def test_priority_goes_with_the_job_and_is_served(srv, engine):
    """A request's priority travels with its job (the queue claims by it: tests/test_queue.py) and a
    prioritised request is served like any other."""
    from cotserve.gateway.jobs import JobFactory
    from cotserve.gateway.schemas import ChatCompletionRequest

    factory = JobFactory(GatewaySettings(model_name=MODEL), PromptBuilder(engine.tokenizer, 2048))
    job, _ = asyncio.run(factory.chat_job(ChatCompletionRequest(model=MODEL, priority=-2, max_tokens=2,
                                                                messages=[{"role": "user", "content": "hi"}])))
    assert Job.from_json(job.to_json()).priority == -2
    assert chat(srv, max_tokens=2, priority=-2)["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("patch,spec,field", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}, "response_format"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}, "structured_outputs"),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}, "guided_regex"),
    ({"guided_json": {"type": "object"}}, {"json": {"type": "object"}}, "guided_json"),
])
def test_constrained_output_goes_to_the_vllm_engine(engine, patch, spec, field):
    """With the vLLM engine behind it (serve --engine vllm) the gateway hands constrained output to
    the worker as vLLM's structured outputs take it (tests/test_vllm_continuous.py: honoured there);
    a native worker that gets such a job (a Redis deployment of mixed workers) refuses it, naming the
    field."""
    from cotserve.gateway.jobs import JobFactory
    from cotserve.gateway.schemas import CompletionRequest

    factory = JobFactory(GatewaySettings(model_name=MODEL, structured_outputs=True),
                         PromptBuilder(engine.tokenizer, 2048))
    sampling = factory.sampling_of(CompletionRequest(model=MODEL, prompt="x", **patch), 3, 8, "max_tokens", None,
                                   "prompt")
    job = Job.from_json(Job(prompt_ids=[1, 2, 3], sampling=sampling).to_json())
    job.sampling.pop("n")
    params = SamplingParams(**job.sampling)
    assert (params.structured, params.structured_field) == (spec, field)
    with pytest.raises(RequestError) as err:
        engine.check_request(GenRequest([1, 2, 3], params))
    assert err.value.field == field


def test_constrained_output_asked_twice_or_without_a_schema_is_refused(engine):
    from cotserve.gateway.errors import APIError
    from cotserve.gateway.jobs import JobFactory
    from cotserve.gateway.schemas import CompletionRequest

    factory = JobFactory(GatewaySettings(model_name=MODEL, structured_outputs=True),
                         PromptBuilder(engine.tokenizer, 2048))
    for patch, param in [({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
                         ({"structured_outputs": {"whitespace": "a"}}, "structured_outputs")]:
        with pytest.raises(APIError) as err:
            factory.sampling_of(CompletionRequest(model=MODEL, prompt="x", **patch), 3, 8, "max_tokens", None,
                                "prompt")
        assert err.value.status == 400 and err.value.param == param, (patch, err.value.message)


def test_the_queue_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cotserve.queue.base; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the sampler against hand computations --------------------------------------------------------
def test_apply_penalties_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, out = [0, 4], [1, 3, 3]
    got = apply_penalties(logits, prompt, out, presence=0.5, frequency=0.25, repetition=2.0)
    # repetition over prompt + generated ({0, 1, 3, 4}): positive / 2, negative * 2
    # then frequency (counts: 1 -> 1, 3 -> 2) and presence (1 and 3 once each)
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2 - 0.5 - 0.5, -2.0 * 2])
    assert torch.allclose(got, want)
    assert torch.equal(apply_penalties(logits, prompt, [], 1.0, 1.0, 1.0), logits)


def test_logit_bias_and_min_p_by_hand():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(apply_logit_bias(logits, {0: 5.0, 2: -1.5, 99: 7.0}), torch.tensor([6.0, 2.0, 1.5]))
    # probabilities e^1 : e^2 : e^3 (0.090, 0.245, 0.665): min_p 0.3 keeps p >= 0.2 (tokens 1, 2)
    kept = filter_min_p(logits, 0.3)
    assert torch.isinf(kept[0]) and torch.equal(kept[1:], logits[1:])
    assert torch.isfinite(filter_min_p(logits, 1.0)).tolist() == [False, False, True]
    assert torch.equal(filter_min_p(logits, 0.0), logits)
    p = SamplingParams(temperature=1.0, min_p=1.0, seed=0)
    gen = p.make_generator(torch.device("cpu"))
    assert {sample_next(torch.tensor([0.1, 0.3, 0.2]), p, gen) for _ in range(20)} == {1}


def test_process_logits_min_tokens_by_hand():
    p = SamplingParams(min_tokens=2, stop_token_ids=[1], logit_bias={0: 1.0})
    row = torch.tensor([0.0, 5.0, 1.0, 4.0])
    got = process_logits(row, p, [9], [2], end_ids={3})
    assert got.tolist() == [1.0, float("-inf"), 1.0, float("-inf")]  # bias, then the ends masked
    assert process_logits(row, p, [9], [2, 2], end_ids={3}).tolist() == [1.0, 5.0, 1.0, 4.0]


@pytest.mark.parametrize("kw,field", [
    ({"min_p": -0.1}, "min_p"), ({"min_tokens": 300}, "min_tokens"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {"3": 150}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
])
def test_sampling_params_refuse_bad_values(kw, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kw)
    assert info.value.field == field


# -- vLLM: the fields reach its SamplingParams ---------------------------------------------------
def test_vllm_sampling_params_carry_the_fields():
    pytest.importorskip("vllm")
    from cotserve.vllm.params import sampling_params

    s = SamplingParams(max_tokens=10, temperature=0.7, min_p=0.1, min_tokens=3, presence_penalty=0.5,
                       frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={"5": -100.0, "9": 2.5},
                       stop_token_ids=[7, 8], thinking_token_budget=5)
    vp = sampling_params(GenRequest([1, 2, 3], s), None, 100)
    assert vp.thinking_token_budget == 5
    assert (vp.min_p, vp.min_tokens, vp.presence_penalty, vp.frequency_penalty, vp.repetition_penalty) == (
        0.1, 3, 0.5, -0.25, 1.2)
    assert vp.logit_bias == {5: -100.0, 9: 2.5}
    assert list(vp.stop_token_ids) == [7, 8]
    plain = sampling_params(GenRequest([1, 2, 3], SamplingParams(max_tokens=10)), None, 100)
    assert (plain.min_p, plain.min_tokens, plain.presence_penalty, plain.frequency_penalty,
            plain.repetition_penalty, plain.logit_bias, plain.thinking_token_budget) == (0.0, 0, 0.0, 0.0, 1.0, None, None)


def test_the_continuous_engine_honours_them_too(engine, prompt):
    from cotserve.engine.continuous import ContinuousEngine

    tok = engine.tokenizer
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    eos = tok.eos_token_id
    asks = {"bias": SamplingParams(max_tokens=3, logit_bias={forced: 100.0}),
            "min_tokens": SamplingParams(max_tokens=16, min_tokens=5, logit_bias={eos: 100.0}),
            "penalty": SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0)}
    reqs = {k: GenRequest(list(prompt), p) for k, p in asks.items()}
    ce = ContinuousEngine(engine, slots=4, prefill_chunk=8)
    for r in reqs.values():
        ce.submit(r, "dense", {})
    results = {}
    for deltas in ce.run():
        for d in deltas:
            if d.result is not None:
                results[d.request_id] = d.result
    got = {k: results[r.request_id] for k, r in reqs.items()}
    assert got["bias"].token_ids == [forced] * 3
    assert len(got["min_tokens"].token_ids) == 6 and got["min_tokens"].token_ids[-1] == eos
    alone = engine.generate([GenRequest(list(prompt), asks["penalty"])])[0]
    assert got["penalty"].token_ids == alone.token_ids
