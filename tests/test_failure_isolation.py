"""A failure stays with its request (native engine, bundled model): a sequence whose decoding
raises, claimed beside four healthy ones, ends with a 500 error event while the four finish with
the text they get decoding alone, on the continuous worker and on the static one.

The fault is injected (this is the one fake here, and it says so): StreamingLLM's per-step hook
is patched to raise whenever the batch holds the bad prompt, the way a bug in a policy would. No
request a client can send is known to fail inside a step (the gateway refuses bad options with a
400 before they reach a worker), so the fault cannot be caused otherwise."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.streamingllm import StreamingLLMPolicy
from cotserve.queue import Job
from cotserve.queue.memory import InProcessQueue
from cotserve.worker import ContinuousWorker, Worker

GOOD = ["Once upon a time", "The capital of France is", "List three colours:", "Water boils at"]
BAD = "This request breaks its batch."
OPTS = {"budget": 20, "sinks": 4}
NEW = 8


def _ids(engine, text: str) -> list[int]:
    return engine.encode_prompt(text, chat=False)


@pytest.fixture()
def faulty(engine, monkeypatch):
    bad = _ids(engine, BAD)
    original = StreamingLLMPolicy.after_forward

    def after_forward(self, batch):
        if any(list(row[: len(bad)]) == bad for row in batch.tokens):
            raise RuntimeError("injected fault")
        return original(self, batch)

    monkeypatch.setattr(StreamingLLMPolicy, "after_forward", after_forward)
    return bad


def _alone(engine, text: str) -> list[int]:
    req = GenRequest(_ids(engine, text), SamplingParams(max_tokens=NEW, ignore_eos=True))
    return engine.generate([req], "streamingllm", OPTS)[0].token_ids


def _serve(worker, q, jobs, timeout: float = 300.0) -> dict[str, list[dict]]:
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    deadline = time.time() + timeout
    try:
        while not all(any(e["t"] in ("done", "error") for e in q.published(j.id)) for j in jobs):
            assert time.time() < deadline, "the worker did not answer every job"
            time.sleep(0.05)
    finally:
        worker.stop()
        t.join(60)
    return {j.id: q.published(j.id) for j in jobs}


@pytest.fixture(scope="module")
def expected(engine):
    return {text: _alone(engine, text) for text in GOOD}


@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_a_failing_sequence_fails_alone(engine, expected, faulty, kind):
    q = InProcessQueue()
    cls = ContinuousWorker if kind == "continuous" else Worker
    w = cls(engine, q, worker_id=f"w-iso-{kind}", max_batch=8, max_wait=0.5)
    jobs = []
    for text in [GOOD[0], GOOD[1], BAD, GOOD[2], GOOD[3]]:
        job = Job(prompt_ids=_ids(engine, text), sampling={"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
                  policy="streamingllm", options=dict(OPTS))
        asyncio.run(q.submit(job, 16))
        jobs.append((text, job))
    out = _serve(w, q, [j for _, j in jobs])
    for text, job in jobs:
        events = out[job.id]
        if text == BAD:
            assert events[-1]["t"] == "error" and events[-1]["status"] == 500, events[-1]
            assert "/" not in events[-1]["message"]
            continue
        assert events[-1]["t"] == "done", (text, events[-1])
        ids = [t for e in events if e["t"] == "delta" for t in e["ids"]]
        assert ids == expected[text], text
