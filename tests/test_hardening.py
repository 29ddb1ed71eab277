"""Client input never gives a 5xx: typed policy options, strict JSON types, body limit, key check
before the body, tiny temperatures, errors that keep the connection, the OpenAPI document, and
bounded waits (keep-alive comments, --queue-timeout). Real gateway over HTTP (httpx), the bundled
model in a worker thread where tokens are needed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import ServerThread

import cotserve
from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.policies.options import POLICIES, RENAMED, validate_spec
from cotserve.queue import InProcessQueue
from cotserve.worker import Worker

MODEL = "smollm2-135m-instruct"


class Served:
    def __init__(self, engine, worker: bool = True, max_wait: float = 0.02, **settings):
        self.queue = InProcessQueue()
        self.app = create_app(GatewaySettings(model_name=MODEL, **settings), self.queue,
                              PromptBuilder(engine.tokenizer, engine.info.max_positions))
        self.worker = Worker(engine, self.queue, worker_id="w-hard", max_batch=8, max_wait=max_wait) if worker else None
        self.server = ServerThread(self.app)

    def __enter__(self) -> Served:
        if self.worker is not None:
            self.thread = threading.Thread(target=self.worker.run, daemon=True)
            self.thread.start()
        self.url = self.server.start()
        if self.worker is not None:
            deadline = time.time() + 30
            while httpx.get(self.url + "/ready").status_code != 200:
                assert time.time() < deadline, "not ready"
                time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        if self.worker is not None:
            self.worker.stop()
            self.thread.join(timeout=60)


def chat(**kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 6, "temperature": 0}
    b.update(kw)
    return b


# -- typed options --------------------------------------------------------------------------------
def test_option_models_match_the_policy_configs():
    from cotserve.policies.registry import REGISTRY, available

    assert sorted(available()) == sorted(POLICIES)
    for name, (axis, model) in POLICIES.items():
        cls = REGISTRY[name]
        assert cls.axis == axis, name
        fields = {f.name: f.default for f in dataclasses.fields(cls.config_cls)}
        assert list(fields) == list(model.model_fields), name
        for field, info in model.model_fields.items():
            want, got = fields[field], info.default
            assert want == got or (want != want and got != got), f"{name}.{field}: {want!r} != {got!r}"
            assert info.description, f"{name}.{field} has no description"
        for old, new in RENAMED.get(name, {}).items():
            assert new in model.model_fields and old not in model.model_fields


def _bad_values(annotation) -> list:
    if annotation is bool:
        return [None, 0, "yes", [], {}]
    if annotation is int:
        return [None, True, 1.5, "3", [1], {"a": 1}]
    if annotation is float:
        return [None, True, "0.5", [0.5], {"a": 1}]
    return [None, 5, ["auto"], {"a": 1}, "no-such-choice"]  # strings and choices


def option_cases() -> list[tuple[str, dict, str]]:
    cases = []
    for name, (_, model) in POLICIES.items():
        for field, info in model.model_fields.items():
            if field in ("calibration", "vector", "thought_rules"):
                continue  # server only (refused for that reason, tested in test_gateway)
            for bad in _bad_values(info.annotation):
                if info.annotation is str and bad == "no-such-choice" and "Literal" not in str(info.annotation):
                    continue
                cases.append((name, {field: bad}, f"cotserve.options.{field}"))
    for name, renamed in RENAMED.items():
        for old in renamed:
            cases.append((name, {old: 1}, f"cotserve.options.{old}"))
            cases.append((name, {f"{name}.{old}": 1}, f"cotserve.options.{name}.{old}"))
    cases += [("sfi", {"k": 0}, "cotserve.options.k"), ("sinkrouter", {"target_skip": 1.0}, "cotserve.options.target_skip"),
              ("steering", {"layer": -2}, "cotserve.options.layer"), ("skipkv+sfi", {"sfi.kernel": 7}, "cotserve.options.sfi.kernel"),
              ("quest", {"budget": 4, "page_size": 16}, "cotserve.options")]
    return cases


def test_more_than_170_bad_option_cases_get_400_with_the_path(engine):
    cases = option_cases()
    assert len(cases) >= 170
    with Served(engine, worker=False) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        for spec, options, param in cases:
            r = c.post("/v1/chat/completions", json=chat(cotserve={"policy": spec, "options": options}))
            assert r.status_code == 400, (spec, options, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "invalid_policy", (spec, options, err)
        # non-finite numbers are not JSON: 400 before any policy code runs
        for raw in ('{"k": Infinity}', '{"budget": NaN}', '{"budget": -Infinity}'):
            text = json.dumps(chat(cotserve={"policy": "quest"})).replace('"policy": "quest"}', '"policy": "quest", '
                                                                           f'"options": {raw}}}')
            r = c.post("/v1/chat/completions", content=text, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_renamed_options_are_refused_with_the_new_name():
    from cotserve.policies.options import OptionError
    from cotserve.policies.registry import build_policy

    with pytest.raises(OptionError, match="renamed to 'interval'"):
        validate_spec("h2o", {"every": 2})
    with pytest.raises(OptionError, match="renamed to 'pool_width'"):
        build_policy("snapkv", {"kernel": "7"})
    assert build_policy("streamingllm", {"sinks": "2", "interval": "4", "budget": "20"}).parts[0].config.sinks == 2


# -- request bodies -------------------------------------------------------------------------------
def test_strict_types_body_limit_and_key_before_body(engine):
    with Served(engine, worker=False, api_keys=["sekret"], max_body_bytes=64 * 1024) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        good = {"authorization": "Bearer sekret"}
        # the key is checked before the body is read: bad JSON with a wrong key is 401
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/chat/completions", content=b"x" * (65 * 1024), headers=good)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():
            for _ in range(100):
                yield b"x" * 1024

        r = c.post("/v1/chat/completions", content=chunks(), headers=good)  # no Content-Length
        assert r.status_code == 413
        for patch, param in (({"stream": "yes"}, "stream"), ({"ignore_eos": 0}, "ignore_eos"),
                             ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"logprobs": 1}, "logprobs"),
                             ({"functions": [{"name": "f"}]}, "functions")):
            r = c.post("/v1/chat/completions", json=chat(**patch), headers=good)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (patch, r.text)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "tools": [{"type": "function"}]},
                   headers=good)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = c.get("/health")  # the same connection still serves
        assert r.status_code == 200


class _FailingQueue(InProcessQueue):
    """A fake fault (it says so): submit raises an unexpected error, which nothing a client sends
    can cause; it checks that a 500 names nothing of the server and keeps the connection."""

    async def submit(self, job, max_pending):  # noqa: ARG002
        raise RuntimeError("/srv/secret/path/state.db is broken")


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(engine):
    q = _FailingQueue()
    q.heartbeat("w", 600)
    app = create_app(GatewaySettings(model_name=MODEL), q, PromptBuilder(engine.tokenizer, engine.info.max_positions))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "/srv" not in r.text and "secret" not in r.text
        assert r.headers.get("connection", "").lower() != "close"
        assert c.get("/health").status_code == 200


def test_openapi_matches_what_is_served(engine):
    with Served(engine, worker=False) as s:
        spec = httpx.get(s.url + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "ChatCompletionChunk" in spec["components"]["schemas"]
    for path, item in spec["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (path, method)
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "413", "500", "503"} <= set(post["responses"])
    assert post["security"] == [{"HTTPBearer": []}]


def test_empty_host_is_not_loopback_and_is_refused_at_once(tmp_path):
    from cotserve.gateway.auth import is_loopback

    assert not is_loopback("") and not is_loopback("0.0.0.0") and is_loopback("127.0.0.1") and is_loopback("::1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "--host", "", "--port", "1"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode != 0 and "without an API key" in proc.stderr
    assert time.time() - t0 < 15  # refused before any model loads


# -- the worker -----------------------------------------------------------------------------------
def test_tiny_temperature_batched_with_normal_requests(engine):
    """1e-45 and 1e-300 decode greedily; the normal requests of the same batch are untouched."""
    with Served(engine, max_wait=1.0) as s:
        temps = [0.0, 1e-45, 0.0, 1e-300]
        out: list = [None] * len(temps)

        def run(i: int) -> None:
            out[i] = httpx.post(s.url + "/v1/chat/completions", json=chat(temperature=temps[i], seed=7), timeout=120)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(temps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in out), [r.text for r in out]
        texts = {r.json()["choices"][0]["message"]["content"] for r in out}
        assert len(texts) == 1  # all greedy, all the same
        assert max(r.json()["cotserve"].get("batch_size", 1) for r in out) >= 2  # they were batched


def test_policy_errors_found_by_the_worker_are_400_without_paths(engine):
    with Served(engine) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        for cot in ({"policy": "sinkrouter", "options": {"target_skip": 0.99}},
                    {"policy": "steering", "options": {"layer": 100}}):
            r = c.post("/v1/chat/completions", json=chat(cotserve=cot))
            assert r.status_code == 400, r.text
            root = str(Path(cotserve.__file__).resolve().parents[1])
            assert root not in r.text and "/cotserve/" not in r.text, r.text
        r = c.post("/v1/chat/completions", json=chat(seed=2**64 - 1, temperature=0.7, n=2))  # spec-valid seed
        assert r.status_code == 200, r.text


def test_keepalive_and_queue_timeout_without_workers(engine):
    """No worker at all: the stream sends keep-alive comments, then a queue_timeout error event."""
    with Served(engine, worker=False, keepalive_s=0.3, queue_timeout=2.0) as s:
        s.queue.heartbeat("ghost", 600)  # /ready passes; nobody claims
        lines = []
        t0 = time.time()
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=chat(stream=True), timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
        assert time.time() - t0 < 10
        assert any(line.startswith(": keep-alive") for line in lines)
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["error"]["code"] == "queue_timeout"
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"


def test_no_keepalive_comment_by_default(engine):
    """As vllm serve: a waiting stream gets no SSE comment unless --keepalive asks for one (vLLM's
    load generator drops the events that follow a comment)."""
    with Served(engine, worker=False, queue_timeout=1.5) as s:
        s.queue.heartbeat("ghost", 600)  # /ready passes; nobody claims
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=chat(stream=True), timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert not any(line.startswith(":") for line in lines), lines
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["error"]["code"] == "queue_timeout"
