"""The oracle_topk yardstick and the fidelity bench's teacher forcing on the text's true tokens."""

from __future__ import annotations

import pytest
import torch

from cotserve.bench.fidelity import run_fidelity_bench
from cotserve.bench.prompts import long_prompts
from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import CotserveError
from cotserve.policies.oracle import oracle_read_mask


def test_oracle_read_mask_is_sinks_window_and_topk_of_the_rest():
    g = torch.Generator().manual_seed(3)
    b, h, s = 2, 3, 40
    scores = torch.rand(b, h, s, generator=g)
    lens = torch.tensor([40, 31])
    keep = oracle_read_mask(scores, lens, k=5, sinks=2, recent=4)
    for bi in range(b):
        n = int(lens[bi])
        for hi in range(h):
            want = set(range(2)) | set(range(n - 4, n))
            rest = [(float(scores[bi, hi, p]), p) for p in range(n) if p not in want]
            want |= {p for _, p in sorted(rest, reverse=True)[:5]}
            assert set(keep[bi, hi].nonzero().flatten().tolist()) == want


def test_oracle_reads_everything_when_k_covers_it_and_less_otherwise(engine):
    ids = engine.encode_prompt("Explain why the sky is blue in three sentences.")
    req = lambda: GenRequest(ids, SamplingParams(max_tokens=12), record_logprobs=True)  # noqa: E731
    (dense,) = engine.generate([req()], "dense")
    (full,) = engine.generate([req()], "oracle_topk", {"k": 4096})
    assert full.token_ids == dense.token_ids
    torch.testing.assert_close(full.logprobs, dense.logprobs, atol=1e-3, rtol=0)  # float32 log-probs
    (tiny,) = engine.generate([GenRequest(ids, SamplingParams(max_tokens=12), record_logprobs=True,
                                          forced_ids=dense.token_ids)], "oracle_topk",
                              {"k": 1, "recent": 2, "sinks": 1})
    assert not torch.allclose(tiny.logprobs[1:].float(), dense.logprobs[1:].float(), atol=2e-2)


def test_fidelity_is_forced_on_the_true_text_by_default(data_dir, engine):
    report = run_fidelity_bench(["oracle_topk"], context=96, steps=6, batch=1, policy_opt=["k=4096"], policy_file=None,
                                model="smollm2-135m-instruct", data_dir=str(data_dir), device="cpu", dtype="float32")
    assert report["forced"] == "text"
    row = report["results"][0]
    assert row["top1_agreement"] == 1.0 and row["steps_compared"] == 6
    # the reference really was fed the text: dense's tokens are the text's next tokens
    text = long_prompts(engine.tokenizer, 96 + 6, 1, str(data_dir))[0]
    (ref,) = engine.generate([GenRequest(text[:96], SamplingParams(max_tokens=6, ignore_eos=True),
                                         forced_ids=text[96:])], "dense")
    assert ref.token_ids == text[96:]
    greedy = run_fidelity_bench(["oracle_topk"], context=96, steps=6, batch=1, policy_opt=["k=4096"],
                                policy_file=None, model="smollm2-135m-instruct", data_dir=str(data_dir),
                                device="cpu", dtype="float32", forced_mode="greedy")
    assert greedy["forced"] == "greedy"
    with pytest.raises(CotserveError, match="--forced must be"):
        run_fidelity_bench(["sfi"], context=96, steps=6, batch=1, policy_opt=None, policy_file=None,
                           model="smollm2-135m-instruct", data_dir=str(data_dir), device="cpu", dtype="float32",
                           forced_mode="other")


def test_fidelity_bench_reports_progress_on_stderr(data_dir, engine, capsys, monkeypatch):
    """A long bench says where it is (stderr, one line per stage and row); stdout is left to the JSON."""
    monkeypatch.delenv("COTSERVE_BENCH_QUIET", raising=False)
    run_fidelity_bench(["oracle_topk", "dense"], context=96, steps=4, batch=1, policy_opt=["k=4096"],
                       policy_file=None, model="smollm2-135m-instruct", data_dir=str(data_dir), device="cpu",
                       dtype="float32")
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("[fidelity ")]
    assert not out.strip()
    assert any("loaded" in ln for ln in lines) and any("dense reference" in ln for ln in lines), err
    assert [ln.split("] ")[1].split(":")[0] for ln in lines if "row " in ln] == ["row 1/2 oracle_topk",
                                                                                  "row 2/2 dense"], err
    monkeypatch.setenv("COTSERVE_BENCH_QUIET", "1")
    run_fidelity_bench(["dense"], context=96, steps=2, batch=1, policy_opt=None, policy_file=None,
                       model="smollm2-135m-instruct", data_dir=str(data_dir), device="cpu", dtype="float32")
    assert "[fidelity " not in capsys.readouterr().err
