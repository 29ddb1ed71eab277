"""The OpenAI-compatible gateway, embedded form: gateway + in-process queue + worker thread, served
by uvicorn on a free port, driven by real clients (openai SDK, litellm, raw httpx SSE)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support import ServerThread

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.queue import InProcessQueue
from cotserve.worker import Worker

MODEL = "smollm2-135m-instruct"
PROMPT = "What is 2+2?"


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Embedded:
    """One app + queue + worker thread + server thread."""

    def __init__(self, engine, worker: bool = True, **settings):
        self.queue = InProcessQueue()
        self.settings = GatewaySettings(model_name=MODEL, **settings)
        self.app = create_app(self.settings, self.queue, PromptBuilder(engine.tokenizer, engine.info.max_positions))
        self.worker = Worker(engine, self.queue, worker_id="w-test", max_batch=4) if worker else None
        self.server = ServerThread(self.app)

    def __enter__(self):
        if self.worker is not None:
            self.wthread = threading.Thread(target=self.worker.run, daemon=True)
            self.wthread.start()
        self.url = self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()
        if self.worker is not None:
            self.worker.stop()
            self.wthread.join(timeout=60)


@pytest.fixture(scope="module")
def server(engine):
    with Embedded(engine) as s:
        wait_for(lambda: httpx.get(s.url + "/ready").status_code == 200, what="ready")
        yield s


def greedy(engine, text: str, n: int, ignore_eos: bool = False) -> str:
    ids = engine.apply_chat_template([{"role": "user", "content": text}])
    (res,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=n, ignore_eos=ignore_eos))])
    return res.text


def post(url, body, **kw):
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120, **kw)


def body(**kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    b.update(kw)
    return b


# -- clients -------------------------------------------------------------------------------------
def test_openai_sdk_plain_and_streaming(server, engine):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    want = greedy(engine, PROMPT, 12)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=12, temperature=0,
                                       extra_body={"cotserve": {"policy": "dense"}})
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["cotserve"]["policy"] == "dense"

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_litellm(server, engine):
    import litellm

    r = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    assert r.choices[0].message.content == greedy(engine, PROMPT, 8)
    parts = litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="unused",
                               messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0,
                               stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == greedy(engine, PROMPT, 8)


def test_raw_sse_format(server, engine):
    lines = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert all(ln == "" or ln.startswith("data: ") for ln in lines)  # nothing but data lines and blanks
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert len({o["id"] for o in objs}) == 1
    assert all(o["object"] == "chat.completion.chunk" and o["model"] == MODEL for o in objs)
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" in o for o in objs)  # null until the last one when include_usage is set
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["total_tokens"] > 0
    assert objs[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs[:-1])
    assert text == greedy(engine, PROMPT, 8)


def test_first_sse_chunk_carries_the_first_generated_token(engine):
    """Time to first token means the first generated token: nothing but SSE comments leaves before
    the worker has produced a token, and the first chunk holds the role and that token's text."""
    with Embedded(engine, worker=False) as s:
        s.queue.heartbeat("w-late", 60)  # a registered worker that has not claimed anything yet
        got: list[tuple[float, str]] = []

        def read():
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=120,
                              json=body(stream=True, max_tokens=4)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append((time.time(), line[len("data: "):]))

        t = threading.Thread(target=read, daemon=True)
        t.start()
        time.sleep(1.5)
        assert got == []  # no role chunk before generation
        w = Worker(engine, s.queue, worker_id="w-late", max_batch=4)
        started = time.time()
        wt = threading.Thread(target=w.run, daemon=True)
        wt.start()
        try:
            t.join(120)
        finally:
            w.stop()
            wt.join(60)
        first = json.loads(got[0][1])
        assert got[0][0] >= started
        delta = first["choices"][0]["delta"]
        assert delta["role"] == "assistant" and delta["content"]
        assert greedy(engine, PROMPT, 4).startswith(delta["content"])


def test_request_shapes(server, engine):
    # text parts, developer role, unknown fields, max_completion_tokens, stop strings
    want = greedy(engine, PROMPT, 8)
    r = post(server.url, body(messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                              frequency_penalty=0, some_future_field={"x": 1}, user="u1", n=1))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    r = post(server.url, body(max_tokens=None, max_completion_tokens=3))
    assert r.json()["usage"]["completion_tokens"] == 3
    stop_word = want.split()[2]
    r = post(server.url, body(stop=[stop_word]))
    content = r.json()["choices"][0]["message"]["content"]
    assert stop_word not in content and want.startswith(content) and r.json()["choices"][0]["finish_reason"] == "stop"
    seeded = [post(server.url, body(temperature=1.0, seed=11, max_tokens=10)).json()["choices"][0]["message"]["content"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_ops_endpoints(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/ready").json()
    assert ready["status"] == "ready" and ready["workers"] == 1
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert err(httpx.get(server.url + "/v1/models/nope"), 404)["code"] == "model_not_found"
    spec = httpx.get(server.url + "/openapi.json").json()
    post_op = spec["paths"]["/v1/chat/completions"]["post"]
    assert post_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "cotserve" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "text/event-stream" in post_op["responses"]["200"]["content"]
    post(server.url, body(max_tokens=2))
    text = httpx.get(server.url + "/metrics").text
    for name in ("cotserve_requests_total{status=\"200\"}", "cotserve_completion_tokens_total",
                 "cotserve_queue_pending", "cotserve_queue_wait_seconds_bucket",
                 "cotserve_time_to_first_token_seconds", "cotserve_decode_tokens_per_second",
                 "cotserve_policy_telemetry_sum{key=\"padding_fraction\",policy=\"dense\"}",
                 "cotserve_policy_telemetry_count{key=\"padding_fraction\",policy=\"dense\"}"):
        assert name in text, name


# -- errors --------------------------------------------------------------------------------------
def err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


@pytest.mark.parametrize("patch,param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"cotserve": {"policy": "no-such-policy"}}, "cotserve.policy"),
    ({"cotserve": {"policy": "dense", "options": {"k": 3}}}, "cotserve.options.k"),
    ({"cotserve": {"policy": "sinkrouter", "options": {"calibration": "/etc/passwd"}}}, "cotserve.options.calibration"),
    ({"cotserve": {"polcy": "dense"}}, "cotserve.polcy"),
    ({"model": None}, "model"),
    ({"seed": 2**70}, "seed"),
    ({"stop": [1, 2]}, "stop"),
])
def test_400_names_the_field(server, patch, param):
    e = err(post(server.url, body(**patch)), 400)
    assert e["param"] == param and e["type"] == "invalid_request_error"


def test_400_bad_json(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    err(r, 400)


def test_404_unknown_model(server):
    e = err(post(server.url, body(model="gpt-17")), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    assert 'cotserve_requests_total{status="404"}' in httpx.get(server.url + "/metrics").text
    from openai import NotFoundError, OpenAI

    with pytest.raises(NotFoundError):
        OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(
            model="gpt-17", messages=[{"role": "user", "content": "hi"}])


def test_context_length_exceeded(server):
    long = "hello " * 9000
    e = err(post(server.url, body(messages=[{"role": "user", "content": long}])), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "messages"
    e = err(post(server.url, body(max_tokens=8190)), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "max_tokens"


def test_401_without_key(engine):
    with Embedded(engine, worker=False, api_keys=["sekrit"]) as s:
        e = err(post(s.url, body()), 401)
        assert e["code"] == "invalid_api_key"
        err(httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        from openai import AuthenticationError, OpenAI

        with pytest.raises(AuthenticationError):
            OpenAI(base_url=s.url + "/v1", api_key="nope").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_503_when_no_worker(engine):
    with Embedded(engine, worker=False) as s:
        assert err(httpx.get(s.url + "/ready"), 503)["code"] == "not_ready"
        r = post(s.url, body())
        assert err(r, 503)["code"] == "not_ready" and r.headers["retry-after"]


def test_429_when_queue_full_then_disconnect_cancels(engine):
    """max_batch 1 and room for one waiting job: a long job runs, one waits, the third is refused.
    Closing the clients then cancels both (the running one stops decoding, the slot frees up)."""
    with Embedded(engine, max_pending=1) as s:
        s.worker.max_batch = 1
        wait_for(lambda: httpx.get(s.url + "/ready").status_code == 200, what="ready")
        long = body(max_tokens=4000, ignore_eos=True, stream=True)
        c1, c2 = httpx.Client(timeout=120), httpx.Client(timeout=120)
        r1 = c1.send(c1.build_request("POST", s.url + "/v1/chat/completions", json=long), stream=True)
        lines = r1.iter_lines()
        got = 0
        for line in lines:  # the first job is running once content arrives
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                got += 1
                if got == 2:
                    break
        r2 = c2.send(c2.build_request("POST", s.url + "/v1/chat/completions", json=long), stream=True)
        wait_for(lambda: len(s.queue._pending) == 1, what="second job pending")
        r3 = post(s.url, body())
        e = err(r3, 429)
        assert e["code"] == "queue_full" and int(r3.headers["retry-after"]) >= 1
        (running,) = [jid for jid, e in s.queue._jobs.items() if e.state == "claimed"]
        r1.close()
        c1.close()
        r2.close()
        c2.close()
        wait_for(lambda: s.queue._jobs[running].state == "cancelled", what="running job cancelled")
        wait_for(lambda: not s.queue._pending and not any(e.state == "claimed" for e in s.queue._jobs.values()),
                 what="nothing pending or running")
        done = s.queue.published(running)[-1]
        assert done["t"] == "done" and done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 4000
        assert "cotserve_cancelled_total 2.0" in httpx.get(s.url + "/metrics").text
        assert post(s.url, body(max_tokens=2)).status_code == 200  # the slot serves the next request


def test_non_streaming_disconnect_cancels(server):
    with httpx.Client(timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(server.url + "/v1/chat/completions", json=body(max_tokens=4000, ignore_eos=True))
    wait_for(lambda: any(e.state == "cancelled" for e in server.queue._jobs.values()), what="job cancelled")
    wait_for(lambda: not any(e.state == "claimed" for e in server.queue._jobs.values()), what="slot free")


# -- command line ----------------------------------------------------------------------------------
def _cli(*args, env_extra=None):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COTSERVE_API_KEYS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "cotserve.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_serve_refuses_public_bind_without_key():
    r = _cli("serve", "--host", "0.0.0.0", "--port", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("error: refusing to serve on 0.0.0.0 without an API key")
    assert "Traceback" not in r.stderr


def test_worker_reports_unreachable_redis():
    r = _cli("worker", "--redis-url", "redis://127.0.0.1:1/0")
    assert r.returncode == 2 and r.stderr.startswith("error: cannot reach Redis at redis://127.0.0.1:1/0")


def test_bench_serve_against_the_server(server, capsys, monkeypatch):
    from cotserve.bench.serve import run_serve_bench

    monkeypatch.delenv("COTSERVE_BENCH_QUIET", raising=False)
    rep = run_serve_bench(server.url, concurrency=2, requests=4, stream=True, max_tokens=3)
    assert rep["ok"] == 4 and rep["errors"] == 0 and rep["model"] == MODEL
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[serve ")]
    assert [ln.split("] ")[1] for ln in progress] == [f"{i}/4 requests done (0 failed)" for i in range(1, 5)]
    assert 4 <= rep["completion_tokens"] <= 12  # 4 requests, at most 3 tokens each (usage chunks)
    assert set(rep["latency_s"]) == {"p50", "p95", "p99", "mean"} and rep["ttft_s"]["p50"] <= rep["latency_s"]["p99"]


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_time_tokens_as_they_arrive(server):
    """TTFT is observed at the first token for streamed and non-streamed requests alike (below the
    request's latency), one inter-token gap per later token, token-length histograms, and vLLM's
    metric names with the model name."""
    before = _samples(server.url)
    r = post(server.url, body(max_tokens=8, ignore_eos=True))
    assert r.status_code == 200
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body(max_tokens=8, ignore_eos=True, stream=True),
                      timeout=120) as s:
        assert s.status_code == 200
        for _ in s.iter_lines():
            pass
    after = _samples(server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("cotserve_time_to_first_token_seconds_count") == 2
    assert delta("cotserve_request_latency_seconds_count") == 2
    assert delta("cotserve_time_to_first_token_seconds_sum") < delta("cotserve_request_latency_seconds_sum")
    assert delta("cotserve_inter_token_latency_seconds_count") == 2 * 7  # 8 tokens: 7 gaps each
    assert delta("cotserve_request_generation_tokens_sum", policy="dense") == 16
    assert delta("cotserve_request_generation_tokens_count", policy="dense") == 2
    assert delta("vllm:time_to_first_token_seconds_count", model_name=MODEL) == 2
    assert delta("vllm:generation_tokens_total", model_name=MODEL) == 16
    assert delta("vllm:request_success_total", model_name=MODEL, finished_reason="length") == 2
    assert ("vllm:num_requests_waiting", (("model_name", MODEL),)) in after


# -- X-Request-Id --------------------------------------------------------------------------------
def test_x_request_id_round_trip_into_both_log_lines(server, caplog):
    """A client's X-Request-Id comes back on the response (streamed or not, errors too) and names
    the request in the gateway's `enqueued` line and the worker's request line; without one (or
    with an unusable one) the server makes one up."""
    import logging

    caplog.set_level(logging.INFO, logger="cotserve")
    r = post(server.url, body(), headers={"X-Request-Id": "trace-42.a"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a"
    job_id = r.json()["id"]
    wait_for(lambda: any(getattr(rec, "request_id", None) == job_id and rec.name == "cotserve.requests"
                         for rec in caplog.records), what="the worker's request line")
    lines = [rec for rec in caplog.records if getattr(rec, "request_id", None) == job_id]
    assert {rec.name for rec in lines} >= {"cotserve.gateway", "cotserve.requests"}
    assert all(rec.x_request_id == "trace-42.a" for rec in lines)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body(stream=True), timeout=120,
                      headers={"x-request-id": "s-1"}) as s:
        assert s.headers["x-request-id"] == "s-1"
        s.read()
    bad = post(server.url, body(max_tokens=-1), headers={"X-Request-Id": "e-7"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e-7"
    fresh = post(server.url, body(), headers={"X-Request-Id": "has space"})
    assert fresh.headers["x-request-id"] != "has space" and len(fresh.headers["x-request-id"]) == 32
    assert len(httpx.get(server.url + "/health").headers["x-request-id"]) == 32
