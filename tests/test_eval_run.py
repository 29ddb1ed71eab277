"""End-to-end eval runs on the bundled model: local mode (the native engine) on 3 items of every
suite, resume after an interruption, side-by-side variants, and endpoint mode through the openai
SDK against a real HTTP server (uvicorn + a small OpenAI-compatible FastAPI app defined here that
wraps the same real engine; the project's own gateway is not needed for this)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from cotserve.errors import CotserveError
from cotserve.eval.backends import EndpointBackend, LocalBackend
from cotserve.eval.loaders import parse_suites
from cotserve.eval.runner import EvalConfig, parse_variants, run_eval
from cotserve.eval.sandbox import Limits, bwrap_problem

# model-written programs run only in bubblewrap: without it the code suite is left out here
ALL = "gsm8k,math500,aime24,gpqa" + (",livecodebench" if bwrap_problem() is None else "")
N_SUITES = len(ALL.split(","))
MAX_TOKENS = 16


class Recording:
    """Wraps a real backend and records which jobs it was asked to run. With `stop_after`, raises
    KeyboardInterrupt after that many replies: the interruption a user causes with Ctrl-C, which a
    test cannot send to its own process at a chosen point otherwise."""

    def __init__(self, inner, stop_after: int | None = None):
        self.inner, self.stop_after, self.asked = inner, stop_after, []

    def describe(self):
        return self.inner.describe()

    def check(self, policy, options):
        self.inner.check(policy, options)

    def drain(self):
        return self.inner.drain()

    def run(self, jobs):
        self.asked.extend(j.key for j in jobs)
        for n, out in enumerate(self.inner.run(jobs), 1):
            yield out
            if self.stop_after is not None and n >= self.stop_after:
                raise KeyboardInterrupt


def config(out, data_dir, suites=ALL, policy="dense", limit=3, **kw) -> EvalConfig:
    return EvalConfig(suites=parse_suites(suites), variants=parse_variants(policy), out=out, data_dir=data_dir,
                      limit=limit, max_tokens=kw.pop("max_tokens", MAX_TOKENS), progress=False,
                      code_limits=Limits(timeout_s=3.0, memory_mb=512),
                      redundancy_model=kw.pop("redundancy_model", None), **kw)


@pytest.fixture(scope="module")
def local(engine):
    return LocalBackend(engine, "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def full_run(local, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_all")
    rec = Recording(local)
    results = run_eval(config(out, data_dir, redundancy_model="all-MiniLM-L6-v2"), rec)
    return out, results, rec


def test_three_items_per_suite_write_every_output(full_run):
    out, results, rec = full_run
    assert len(rec.asked) == 3 * N_SUITES
    for name in ("results.json", "predictions.jsonl", "report.md", "run_config.json",
                 "accuracy_vs_tokens.png", "throughput.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in ("accuracy_vs_tokens.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "results.json").read_text())
    assert saved["suites"] == ALL.split(",") and saved["policies"] == ["dense"]
    assert len(saved["runs"]) == N_SUITES
    for run in saved["runs"]:
        assert run["n"] == 3 and run["items"] == 3 and run["errors"] == 0
        assert 0 <= run["ci95"][0] <= (run["accuracy"] or 0) <= run["ci95"][1] <= 1
        assert 0 < run["generated_tokens"]["mean"] <= MAX_TOKENS
        assert run["throughput_tok_s"] > 0 and run["decode_tok_s"] > 0 and run["wall_s"] > 0
        assert run["telemetry"]["kv_bytes_peak"] > 0
    lines = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * N_SUITES
    assert {(r["suite"], r["policy"]) for r in lines} == {(s, "dense") for s in ALL.split(",")}
    for r in lines:
        assert isinstance(r["correct"], bool) and r["completion_tokens"] <= MAX_TOKENS
        assert r["finish_reason"] in ("stop", "length") and "kv_bytes_peak" in r["telemetry"]
    report = (out / "report.md").read_text()
    for s in ALL.split(","):
        assert f"## {s}" in report
    assert "![accuracy_vs_tokens](accuracy_vs_tokens.png)" in report


def test_grades_in_the_log_match_the_graders(full_run, data_dir):
    """The logged verdicts are recomputed from the logged replies by the graders."""
    from cotserve.eval.graders import grade
    from cotserve.eval.loaders import load_suite

    out, _, _ = full_run
    items = {(i.suite, i.id): i for ref in parse_suites(ALL) for i in load_suite(ref, data_dir, limit=3)}
    for line in (out / "predictions.jsonl").read_text().splitlines():
        r = json.loads(line)
        g = grade(items[(r["suite"], r["id"])], r["content"], code_limits=Limits(timeout_s=3.0, memory_mb=512),
                  finish_reason=r.get("finish_reason"))
        assert g.correct == r["correct"] and g.extracted == r["extracted"]


def test_resume_skips_finished_items(full_run, local, data_dir, tmp_path):
    src, results, _ = full_run
    out = tmp_path / "resumed"
    shutil.copytree(src, out)
    again = Recording(local)
    res2 = run_eval(config(out, data_dir), again)
    assert again.asked == []  # nothing regenerated
    assert [(r["suite"], r["n"], r["correct"]) for r in res2["runs"]] == \
        [(r["suite"], r["n"], r["correct"]) for r in results["runs"]]
    more = Recording(local)
    res3 = run_eval(config(out, data_dir, suites="gsm8k", limit=4), more)
    assert more.asked == [("gsm8k", "dense", "gsm8k-test-3", 0)]  # only the new item
    assert res3["runs"][0]["n"] == 4
    with pytest.raises(CotserveError, match="other settings"):
        run_eval(config(out, data_dir, suites="gsm8k", max_tokens=MAX_TOKENS + 1), Recording(local))


def test_interrupted_side_by_side_run_resumes(local, data_dir, tmp_path):
    out = tmp_path / "interrupted"
    first = Recording(local, stop_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(out, data_dir, suites="gsm8k", policy="a=dense,b=dense", limit=2, max_tokens=8), first)
    logged = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(logged) == 1
    done_key = (logged[0]["suite"], logged[0]["policy"], logged[0]["id"], logged[0]["sample"])
    with open(out / "predictions.jsonl", "a") as f:
        f.write('{"suite": "gsm8k", "policy": "a", "id"')  # a torn write, as a kill mid-line leaves
    second = Recording(local)
    res = run_eval(config(out, data_dir, suites="gsm8k", policy="a=dense,b=dense", limit=2, max_tokens=8), second)
    assert done_key not in second.asked and len(second.asked) == 3
    assert [(r["policy"], r["n"]) for r in res["runs"]] == [("a", 2), ("b", 2)]
    report = (out / "report.md").read_text()
    assert "| metric | a | b |" in report and "| suite | a | b |" in report


# -- endpoint mode -------------------------------------------------------------------------------

def make_app(engine, seen: list):
    """A minimal OpenAI-compatible chat-completions app over the real engine (test helper)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from cotserve.engine.native import GenRequest
    from cotserve.engine.sampling import SamplingParams
    from cotserve.engine.textproc import split_reasoning
    from cotserve.errors import PolicyError
    from cotserve.policies.registry import build_policy

    app = FastAPI()
    lock = threading.Lock()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "bundled", "object": "model", "created": 0, "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        seen.append(body)
        cs = body.get("cotserve") or {}
        try:
            build_policy(cs.get("policy", "dense"), cs.get("options"))
        except PolicyError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": "cotserve.policy", "code": None}}, status_code=400)
        ids = engine.apply_chat_template(body["messages"])
        params = SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                                seed=body.get("seed"))
        if body.get("stream"):
            return StreamingResponse(sse(GenRequest(ids, params), cs, body["model"]), media_type="text/event-stream")
        with lock:
            (res,) = engine.generate([GenRequest(ids, params)], cs.get("policy", "dense"), cs.get("options"))
        reasoning, content = split_reasoning(res.text)
        return {
            "id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "finish_reason": res.finish_reason,
                         "message": {"role": "assistant", "content": content, "reasoning_content": reasoning}}],
            "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                      "total_tokens": res.prompt_tokens + res.completion_tokens},
            "cotserve": res.telemetry,
        }

    def sse(req, cs, model):
        """OpenAI chat-completion chunks, one per engine step, usage and telemetry in the last."""
        def chunk(delta, finish=None, **extra):
            body = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(body)}\n\n"

        with lock:
            yield chunk({"role": "assistant", "content": ""})
            for deltas in engine.stream([req], cs.get("policy", "dense"), cs.get("options")):
                for d in deltas:
                    if d.text:
                        yield chunk({"content": d.text})
                    if d.result is not None:
                        res = d.result
                        yield chunk({}, res.finish_reason, cotserve=res.telemetry)
                        usage = {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                                 "total_tokens": res.prompt_tokens + res.completion_tokens}
                        yield (f"data: {json.dumps({'id': 'chatcmpl-test', 'object': 'chat.completion.chunk', 'created': 0, 'model': model, 'choices': [], 'usage': usage, 'cotserve': res.telemetry})}\n\n")
        yield "data: [DONE]\n\n"

    return app


@pytest.fixture(scope="module")
def server(engine):
    import uvicorn

    seen: list = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(engine, seen), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    th.join(timeout=10)


def test_endpoint_mode_carries_the_policy_per_request(server, data_dir, tmp_path):
    url, seen = server
    backend = EndpointBackend(url + "/v1", "test-key", None, concurrency=2)
    assert backend.model == "bundled"  # taken from /v1/models
    res = run_eval(config(tmp_path, data_dir, suites="gsm8k", policy="a=dense,b=dense", limit=2, max_tokens=12),
                   backend)
    assert len(seen) == 4 and all(b["cotserve"] == {"policy": "dense", "options": {}} for b in seen)
    assert all(b["max_tokens"] == 12 and b["model"] == "bundled" for b in seen)
    recs = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["telemetry"]["kv_bytes_peak"] > 0 for r in recs)  # the response's cotserve
    assert all(0 < r["completion_tokens"] <= 12 for r in recs)
    assert [(r["policy"], r["n"], r["errors"]) for r in res["runs"]] == [("a", 2, 0), ("b", 2, 0)]
    assert json.loads((tmp_path / "run_config.json").read_text())["backend"]["mode"] == "endpoint"
    for r in recs:  # streamed: its own first-token time, inside its own latency
        lat = r["latency"]
        assert 0 <= lat["queue_wait_s"] <= lat["ttft_s"] <= lat["latency_s"]
        assert lat["decode_s"] == pytest.approx(lat["latency_s"] - lat["ttft_s"], abs=2e-3)
    assert "## Latency" in (tmp_path / "report.md").read_text()


def test_ctrl_c_in_endpoint_mode_keeps_replies_in_flight(server, data_dir, tmp_path):
    """Stopped after the first reply, with up to two requests in flight (concurrency 2; the pool may
    have started the next one already): those are awaited and logged, the ones not started dropped."""
    url, _ = server
    rec = Recording(EndpointBackend(url, None, "bundled", concurrency=2), stop_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(tmp_path, data_dir, suites="gsm8k", limit=4, max_tokens=8), rec)
    logged = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert 2 <= len(logged) <= 3 and all(r.get("error") is None for r in logged)


def test_endpoint_refusing_a_policy_stops_the_run(server, data_dir, tmp_path):
    url, _ = server
    backend = EndpointBackend(url, None, "bundled", concurrency=2)
    with pytest.raises(CotserveError, match="HTTP 400.*nosuchpolicy"):
        run_eval(config(tmp_path, data_dir, suites="gsm8k", policy="nosuchpolicy", limit=2), backend)


def test_unreachable_endpoint_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CotserveError, match="cannot reach"):
        EndpointBackend(f"http://127.0.0.1:{port}", None, None)


# -- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--suite", "gsm9k"], "unknown suite"),
    (["--suite", "gsm8k", "--policy", "nosuchpolicy"], "unknown policy"),
    (["--suite", "gsm8k", "--limit", "0"], "--limit"),
])
def test_cli_bad_input_is_one_error_line(args, message, tmp_path, data_dir):
    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", *args, "--out", str(tmp_path),
                        "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and message in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_mistyped_custom_path_fails_before_loading_the_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", f"custom:{tmp_path}/nope.jsonl",
                        "--out", str(tmp_path / "o"), "--model", str(tmp_path / "no-such-model")],
                       capture_output=True, text=True, timeout=120)
    # the model path is bad too: the suite error comes first, so no model was loaded
    assert r.returncode == 2 and "nope.jsonl does not exist" in r.stderr and "Traceback" not in r.stderr


def test_local_replies_carry_their_own_latency(full_run):
    out, results, _ = full_run
    recs = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    for r in recs:
        lat = r["latency"]
        assert 0 <= lat["queue_wait_s"] <= lat["ttft_s"] <= lat["latency_s"]
        assert r["extraction"] and r["grader"] and r["run_id"] == results["meta"]["run_id"]
    assert all(r["latency"]["ttft_s"]["n"] == r["n"] for r in results["runs"])
    report = (out / "report.md").read_text()
    assert "## Latency" in report and "answer extraction" in report and "Timing figures" not in report
    red = results["redundancy"]
    assert red["model"] == "all-MiniLM-L6-v2" and len(red["runs"]) == N_SUITES and "## Reasoning redundancy" in report
    assert (out / "redundancy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_a_custom_suite_and_resumes(tmp_path):
    """The whole command in a subprocess on a made-up custom suite (tiny max-tokens)."""
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"uid": f"q{i}", "q": f"What is {i} + {i}?", "a": str(2 * i)}) + "\n"
                            for i in (1, 2)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cotserve.cli", "eval", "--suite", f"custom:{data}:q:a:gsm8k:uid",
           "--max-tokens", "4", "--out", str(out), "--no-progress", "--no-redundancy", "--device", "cpu",
           "--dtype", "float32", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("custom:arith") and "n=2" in r.stdout
    for name in ("results.json", "predictions.jsonl", "report.md", "accuracy_vs_tokens.png", "throughput.png"):
        assert (out / name).is_file(), name
    assert sorted(json.loads(x)["id"] for x in (out / "predictions.jsonl").read_text().splitlines()) == ["q1", "q2"]
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0 and len((out / "predictions.jsonl").read_text().splitlines()) == 2  # nothing redone


# -- endpoint mode against cotserve's own gateway, text completions --------------------------------

@pytest.fixture(scope="module")
def gateway(engine):
    """cotserve's gateway + in-process queue + a worker on the bundled engine."""
    from support import ServerThread

    from cotserve.gateway.app import GatewaySettings, PromptBuilder, create_app
    from cotserve.queue import InProcessQueue
    from cotserve.worker import Worker

    queue = InProcessQueue()
    app = create_app(GatewaySettings(model_name="bundled"), queue,
                     PromptBuilder(engine.tokenizer, engine.info.max_positions))
    worker = Worker(engine, queue, worker_id="w-eval", max_batch=4)
    th = threading.Thread(target=worker.run, daemon=True)
    th.start()
    with ServerThread(app) as url:
        yield url
    worker.stop()
    th.join(timeout=60)


def test_endpoint_completions_api(gateway, engine, tmp_path):
    from cotserve.engine.native import GenRequest
    from cotserve.engine.sampling import SamplingParams
    from cotserve.eval.backends import EvalRequest

    backend = EndpointBackend(gateway, None, None, concurrency=2, api="completions")
    assert backend.describe()["api"] == "completions"
    prompt = "Question: What is 3 + 4?\nAnswer:"
    (out,) = list(backend.run([EvalRequest(("s", "dense", "q", 0), prompt, "dense", {}, 8, 0.0, 1.0, None)]))
    (want,) = engine.generate([GenRequest(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=8))])
    assert out.error is None and out.text == want.text  # the raw prompt, no chat template
    assert out.completion_tokens == want.completion_tokens and out.telemetry["policy"] == "dense"

    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"uid": f"q{i}", "q": f"What is {i} + {i}?", "a": str(2 * i)}) + "\n"
                            for i in (1, 2)))
    cfg = EvalConfig(suites=parse_suites(f"custom:{data}:q:a:gsm8k:uid"), variants=parse_variants("dense"),
                     out=tmp_path / "out", data_dir=None, limit=None, max_tokens=6, progress=False)
    res = run_eval(cfg, backend)
    assert [(r["n"], r["errors"]) for r in res["runs"]] == [(2, 0)]
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["backend"]["api"] == "completions"


def test_cli_api_completions_needs_an_endpoint(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "eval", "--suite", "gsm8k", "--api", "completions",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api completions needs --endpoint" in r.stderr


def test_cli_samples_report_pass_at_k_majority_and_intervals(tmp_path, data_dir):
    """`--suite aime24 --samples 4 --temperature 0.6` on the bundled model (2 items, 8 tokens):
    pass@1, pass@4 and maj@4, each with an interval over the items, in the summary, results.json
    and report.md; every logged sample has its own seed."""
    out = tmp_path / "out"

    def cmd(temperature: str, limit: str, max_tokens: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "cotserve.cli", "eval", "--suite", "aime24", "--samples", "4", "--temperature",
                temperature, "--limit", limit, "--max-tokens", max_tokens, "--data-dir", str(data_dir), "--out", str(out),
                "--no-progress", "--no-redundancy", "--device", "cpu", "--dtype", "float32", "--threads", "1", "--fresh",
                *extra]

    r = subprocess.run(cmd("0.6", "2", "8"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr  # temperature > 0
    (line,) = r.stdout.splitlines()
    for name in ("pass@1=", "pass@4=", "maj@4="):
        assert name in line, line
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"} <= set(run["metrics"]) and run["n"] == 8
    for m in run["metrics"].values():
        assert m["items"] == 2 and 0 <= m["ci95"][0] <= m["value"] <= m["ci95"][1] <= 1
    recs = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted((x["id"], x["sample"]) for x in recs) == sorted((i, s) for i in {x["id"] for x in recs} for s in range(4))
    report = (out / "report.md").read_text()
    assert "## Sampling" in report and "| aime24 | pass@4 |" in report and "| aime24 | maj@4 |" in report
    assert json.loads((out / "run_config.json").read_text())["sampling"]["sources"] == \
        {"temperature": "--temperature", "top_p": "default", "max_tokens": "--max-tokens"}
    # the R1 preset: the bundled model's generation_config.json sets no sampling, so R1's top-p applies;
    # the flags given still win, and greedy with 4 samples warns
    r0 = subprocess.run(cmd("0", "1", "2", "--preset", "r1"), capture_output=True, text=True, timeout=600)
    assert r0.returncode == 0 and "warning: --samples 4 with --temperature 0" in r0.stderr
    conf = json.loads((out / "run_config.json").read_text())
    assert conf["generation"]["top_p"] == 0.95 and conf["generation"]["temperature"] == 0.0
    assert conf["sampling"] == {"preset": "r1", "sources": {"temperature": "--temperature", "top_p": "preset r1",
                                                              "max_tokens": "--max-tokens"}}
    assert "- sampling preset: r1" in (out / "report.md").read_text()


def test_report_only_regrades_old_replies_without_generating(data_dir, tmp_path):
    """A log graded by the first grader (which took the last number of a truncated reply): the
    report-only pass regrades every reply from its stored text, generates nothing, and the
    truncated ones that were counted correct are no longer."""
    from cotserve.eval.backends import LogBackend
    from cotserve.eval.graders import GRADER_VERSION
    from cotserve.eval.loaders import load_suite

    items = load_suite(parse_suites("gsm8k")[0], data_dir, "local", 3)
    (tmp_path / "run_config.json").write_text(json.dumps({
        "generation": {"model": "m", "endpoint": None, "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0},
        "variants": {"dense": {"policy": "dense", "options": {}}}, "backend": {"mode": "local", "model": "m"}}))
    replies = [  # (content, finish reason): cut mid-list / mid-calculation, then a finished one
        (f"1. First leg\n2. Second leg\n{items[0].answer}. Now, calculate the total distance", "length"),
        (f"So far {items[1].answer} * 3", "length"),
        (f"Adding everything up.\nThe answer is {items[2].answer}", "stop"),
    ]
    with open(tmp_path / "predictions.jsonl", "w") as f:
        for it, (content, finish) in zip(items, replies, strict=True):
            f.write(json.dumps({"suite": "gsm8k", "policy": "dense", "id": it.id, "sample": 0, "spec": "dense",
                                "correct": True, "extracted": it.answer, "reference": it.answer,
                                "finish_reason": finish, "completion_tokens": 16, "prompt_tokens": 50,
                                "reasoning_tokens": 0, "t_start": 1.0, "t_end": 2.0, "telemetry": {},
                                "reasoning": None, "content": content}) + "\n")
    cfg = config(tmp_path, data_dir, suites="gsm8k", limit=3, report_only=True)
    cfg.variants[0].options = {}
    res = run_eval(cfg, LogBackend(tmp_path))
    (run,) = res["runs"]
    assert run["n"] == 3 and run["correct"] == 1
    assert run["extraction"] == {"truncated": 2, "marker": 1}
    last = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()][-3:]
    assert all(r["grader"] == GRADER_VERSION and r["regraded_from"] == "unversioned" for r in last)
    with pytest.raises(CotserveError, match="generates nothing"):
        list(LogBackend(tmp_path).run([object()]))
