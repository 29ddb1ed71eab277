"""Client input never gives a 5xx and no message names a server path: policy options the served
model or the server's files cannot satisfy (400 at the gateway, `param` naming the option),
error messages of workers, JSON nested past any parser's recursion, oversized headers (431),
/metrics and the API docs behind the API key, and a data directory named but missing. The real
gateway over HTTP (httpx), with the bundled model in a continuous worker where tokens are needed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import ServerThread

import cotserve
from cotserve.errors import CotserveError
from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
from cotserve.gateway.guard import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS, MAX_JSON_DEPTH
from cotserve.policies.options import OptionError
from cotserve.policies.served import ServedModel
from cotserve.queue import InProcessQueue
from cotserve.worker import make_worker

MODEL = "smollm2-135m-instruct"
ROOT = str(Path(cotserve.__file__).resolve().parents[1])
# a path of the server's filesystem: two or more parts from the root, or the checkout's folder
SERVER_PATH = re.compile(r"(?<![\w.:/])/[\w.+@=,-]+/[\w.+@=,-]+")


def chat(**kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2, "temperature": 0}
    b.update(kw)
    return b


def no_server_path(text: str) -> None:
    assert ROOT not in text and not SERVER_PATH.search(text), text


class Served:
    """The app with an in-process queue; with `worker`, the bundled model in a continuous worker."""

    def __init__(self, engine, worker: bool = True, model: ServedModel | None = None, **settings):
        self.queue = InProcessQueue()
        served = model if model is not None else ServedModel.from_info(engine.info)
        self.app = create_app(GatewaySettings(model_name=MODEL, **settings), self.queue,
                              PromptBuilder(engine.tokenizer, engine.info.max_positions, model=served))
        self.worker = make_worker(engine, self.queue, "continuous", worker_id="w-input", max_batch=8) if worker else None
        self.server = ServerThread(self.app)

    def __enter__(self) -> Served:
        if self.worker is not None:
            self.thread = threading.Thread(target=self.worker.run, daemon=True)
            self.thread.start()
        self.url = self.server.start()
        if self.worker is not None:
            deadline = time.time() + 60
            while httpx.get(self.url + "/ready").status_code != 200:
                assert time.time() < deadline, "not ready"
                time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        if self.worker is not None:
            self.worker.stop()
            self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def served(engine):
    """The bundled model's server, and one that serves a model this checkout has no files for."""
    other = ServedModel("other-model", engine.info.num_layers, engine.info.hidden_size, engine.info.num_kv_heads)
    with Served(engine) as s, Served(engine, worker=False, model=other) as bare:
        yield {"bundled": s.url, "other": bare.url}


# -- per-request options the served model or the server's files cannot satisfy -------------------
# (server, policy, options, param): every option that needs a server file (the sinkrouter
# calibration, steering vectors) or lies within the model's layers (30 for the bundled model)
UNSATISFIABLE = [
    ("bundled", "sinkrouter", {"target_skip": 0.99}, "cotserve.options.target_skip"),
    ("bundled", "sinkrouter", {"first_layers": 3}, "cotserve.options.first_layers"),  # the file has 2
    ("bundled", "sinkrouter", {"first_layers": 100}, "cotserve.options.first_layers"),
    ("bundled", "sinkrouter", {"first_layers": 31, "tau": 0.5}, "cotserve.options.first_layers"),
    ("bundled", "steering", {"layer": 100}, "cotserve.options.layer"),
    ("bundled", "steering", {"layer": 3}, "cotserve.options.layer"),  # no vector shipped there
    ("bundled", "steering", {"steering.layer": 30, "enabled": False}, "cotserve.options.steering.layer"),
    ("bundled", "quest", {"dense_layers": 31}, "cotserve.options.dense_layers"),
    ("bundled", "skipkv+sinkrouter+steering", {"sinkrouter.target_skip": 0.5}, "cotserve.options.sinkrouter.target_skip"),
    ("other", "sinkrouter", {}, "cotserve.policy"),  # no calibration for the model at all
    ("other", "steering", {}, "cotserve.policy"),  # no vector for the model at all
    ("other", "steering", {"layer": 15}, "cotserve.options.layer"),
]


@pytest.mark.parametrize("server,policy,options,param", UNSATISFIABLE,
                         ids=[f"{s}-{p}-{'-'.join(o) or 'defaults'}" for s, p, o, _ in UNSATISFIABLE])
def test_an_option_the_server_cannot_satisfy_is_a_400_naming_it(served, server, policy, options, param):
    cot = {"policy": policy, "options": options}
    for path, body in (("/v1/chat/completions", chat(cotserve=cot)),
                       ("/v1/completions", {"model": MODEL, "prompt": "2+2=", "max_tokens": 2, "cotserve": cot})):
        r = httpx.post(served[server] + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "invalid_policy", (path, err)
        no_server_path(err["message"])


@pytest.mark.parametrize("policy,options", [
    ("sinkrouter", {"target_skip": 0.4}), ("sinkrouter", {"first_layers": 30, "tau": 0.5}),
    ("steering", {"layer": 15}), ("steering", {"layer": 29, "enabled": False}), ("quest", {"dense_layers": 30}),
])
def test_options_the_server_can_satisfy_decode(served, policy, options):
    r = httpx.post(served["bundled"] + "/v1/chat/completions", json=chat(cotserve={"policy": policy, "options": options}),
                   timeout=120)
    assert r.status_code == 200, r.text


def test_a_default_policy_the_model_cannot_run_stops_the_server_at_startup(engine):
    prompts = PromptBuilder(engine.tokenizer, engine.info.max_positions, model=ServedModel.from_info(engine.info))
    with pytest.raises(OptionError, match="target_skip=0.9"):
        create_app(GatewaySettings(model_name=MODEL, policy="sinkrouter", policy_options={"target_skip": "0.9"}),
                   InProcessQueue(), prompts)
    with pytest.raises(OptionError, match="out of range"):
        create_app(GatewaySettings(model_name=MODEL, policy="steering", policy_options={"layer": "40"}),
                   InProcessQueue(), prompts)


def test_the_served_model_is_read_from_its_config():
    prompts = PromptBuilder.from_model(MODEL)
    assert prompts.model == ServedModel(MODEL, 30, 576, 3)


def test_sfi_kernel_paged_without_triton_decodes_through_the_eager_policy(served, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU server: Triton cannot run the paged runtime
    r = httpx.post(served["bundled"] + "/v1/chat/completions",
                   json=chat(cotserve={"policy": "sfi", "options": {"kernel": "paged"}}), timeout=120)
    assert r.status_code == 200, r.text


class _PathLeakingWorker(threading.Thread):
    """A worker that fails every job with a message naming files of its machine (as an error of a
    remote worker's own code could)."""

    def __init__(self, queue: InProcessQueue):
        super().__init__(daemon=True)
        self.queue, self.stop = queue, threading.Event()

    def run(self) -> None:
        self.queue.heartbeat("leaky", 600)
        while not self.stop.is_set():
            for job in self.queue.claim("leaky", 8, 0.05):
                self.queue.publish("leaky", job.id, [{"t": "error", "status": 400, "code": "invalid_policy",
                                                      "message": "cannot read /srv/models/secret/tau.json "
                                                                 "(file:///opt/weights/x.bin)"}])
                self.queue.finish("leaky", job.id, "failed")


def test_a_workers_error_message_reaches_the_client_without_paths(engine):
    q = InProcessQueue()
    app = create_app(GatewaySettings(model_name=MODEL), q, PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = _PathLeakingWorker(q)
    worker.start()
    try:
        with ServerThread(app) as url:
            r = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=60)
            assert r.status_code == 400 and "<tau.json>" in r.text and "<x.bin>" in r.text, r.text
            no_server_path(r.text)
            with httpx.stream("POST", url + "/v1/chat/completions", json=chat(stream=True), timeout=60) as s:
                text = "".join(s.iter_text())
            assert '"error"' in text and "<tau.json>" in text, text
            no_server_path(text)
    finally:
        worker.stop.set()
        worker.join(timeout=10)


# -- the body and the headers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare(engine):
    """No worker: what is refused is refused before the queue."""
    with Served(engine, worker=False) as s:
        yield s.url


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body", [
    "[" * 5000,  # unbalanced, as sent by a fuzzer
    _nested(5000),
    '{"model": "m", "messages": ' + "[" * 5000,
    json.dumps(chat(cotserve={"options": {"k": 0}})).replace('"k": 0', f'"k": {_nested(MAX_JSON_DEPTH)}'),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_deeply_nested_json_is_a_400(bare, path, body):
    r = httpx.post(bare + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and str(MAX_JSON_DEPTH) in r.json()["error"]["message"]


def test_json_nested_up_to_the_limit_reaches_validation(bare):
    # depth MAX_JSON_DEPTH in all: the object, then MAX_JSON_DEPTH - 1 levels below it
    body = f'{{"model": "{MODEL}", "messages": {_nested(MAX_JSON_DEPTH - 1)}}}'
    r = httpx.post(bare + "/v1/chat/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text


@pytest.mark.parametrize("headers", [
    {f"x-h{i}": "a" for i in range(5000)},
    {f"x-h{i}": "a" for i in range(DEFAULT_MAX_HEADERS)},  # with the client's own: over the count
    {"x-big": "a" * (1 << 20)},
    {"x-big": "a" * DEFAULT_MAX_HEADER_BYTES},
], ids=["5000-headers", "one-too-many", "1-MiB", "just-over-64-KiB"])
@pytest.mark.parametrize("method,path", [("GET", "/health"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")])
def test_too_many_or_too_large_headers_are_a_431(bare, headers, method, path):
    with httpx.Client(base_url=bare, timeout=30) as c:
        r = c.request(method, path, headers=headers, json=chat() if method == "POST" else None)
        assert r.status_code == 431, r.text[:300]
        assert r.json()["error"]["code"] == "request_header_fields_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(bare + "/health", headers={f"x-h{i}": "a" * 200 for i in range(100)})  # 100 headers, 20 KB
    assert r.status_code == 200


def test_header_limits_are_settings(engine):
    with Served(engine, worker=False, max_headers=16, max_header_bytes=2048) as s:
        assert httpx.get(s.url + "/health", headers={f"x-h{i}": "a" for i in range(8)}).status_code == 200
        assert httpx.get(s.url + "/health", headers={f"x-h{i}": "a" for i in range(16)}).status_code == 431
        assert httpx.get(s.url + "/health", headers={"x-big": "a" * 2048}).status_code == 431


# -- /metrics and the API docs behind the key -------------------------------------------------------
OPS_PAGES = ("/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


@pytest.mark.parametrize("public", [False, True])
def test_metrics_and_docs_follow_the_api_keys(engine, public):
    with Served(engine, worker=False, api_keys=["sekret"], public_metrics=public) as s, \
            httpx.Client(base_url=s.url, timeout=30) as c:
        for path in OPS_PAGES:
            r = c.get(path)
            if public:
                assert r.status_code == 200, (path, r.text[:200])
            else:
                assert r.status_code == 401, (path, r.text[:200])
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
                assert c.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"authorization": "Bearer sekret"}).status_code == 200, path
        assert c.get("/health").status_code == 200  # probes stay open
        assert c.get("/ready").status_code == 503 and c.get("/ready").json()["error"]["code"] == "not_ready"
        spec = c.get("/openapi.json", headers={"authorization": "Bearer sekret"}).json()
        metrics_op = spec["paths"]["/metrics"]["get"]
        assert ("security" in metrics_op) is not public and ("401" in metrics_op["responses"]) is not public


def test_without_keys_metrics_and_docs_are_open(bare):
    for path in OPS_PAGES:
        assert httpx.get(bare + path).status_code == 200, path


# -- the data directory -----------------------------------------------------------------------------
def test_a_data_dir_named_but_missing_is_an_error(tmp_path, monkeypatch):
    from cotserve.data import data_dir

    missing = str(tmp_path / "nope")
    monkeypatch.delenv("COTSERVE_DATA_DIR", raising=False)
    with pytest.raises(CotserveError, match=r"^--data-dir .*nope does not exist$"):
        data_dir(missing)
    with pytest.raises(CotserveError, match="does not exist"):
        data_dir(missing, required=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CotserveError, match="is not a directory"):
        data_dir(str(tmp_path / "file"))
    monkeypatch.setenv("COTSERVE_DATA_DIR", missing)
    with pytest.raises(CotserveError, match=r"^\$COTSERVE_DATA_DIR .*nope does not exist$"):
        data_dir(required=False)
    assert data_dir(str(tmp_path)) == tmp_path  # the option wins over the variable
    monkeypatch.setenv("COTSERVE_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path


def test_the_cli_names_a_missing_data_dir_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTSERVE_")}
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", "math500", "--data-dir",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: --data-dir {tmp_path / 'nope'} does not exist"]
