"""`cotserve bench decode`: the interleaved timing runs every policy to the same tokens a run of
its own gives, and reports per-policy rows and ratios."""

from __future__ import annotations

from cotserve.bench.decode import time_native, time_native_interleaved
from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.policies.registry import build_policy

PROMPTS = ["Compute 17 times 23 and explain each step.", "List three prime numbers above 50."]


def test_interleaved_decode_gives_each_policy_its_own_tokens_and_rows(engine):
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    runs = [("dense", {}), ("sfi", {"k": 8, "recent": 8, "max_interval": 5, "min_gap": 2})]
    rows, results = time_native_interleaved(engine, prompts, 12, runs)
    assert [r["policy"] for r in rows] == ["dense", "sfi"]
    for (policy, opts), row, res in zip(runs, rows, results, strict=True):
        # the same greedy tokens as the policy alone: interleaving shares nothing but the model
        alone = engine.generate([GenRequest(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts],
                                build_policy(policy, opts))
        assert [r.token_ids for r in sorted(res, key=lambda r: r.prompt_tokens)] == \
            [a.token_ids for a in sorted(alone, key=lambda r: r.prompt_tokens)]
        assert row["generated_tokens"] == 12 * len(prompts)
        assert row["decode_s"] > 0 and row["decode_tok_s"] > 0 and row["prefill_s"] > 0
        assert "decode_s" not in row.get("telemetry", {})
    assert rows[1]["telemetry"]["sfi_slow_steps"] >= 1 and 0 < rows[1]["telemetry"]["sfi_retained_ratio"] < 1
    # how SFI's fast step ran: float32 here (the test model), the kernel where it builds
    from cotserve.kernels import cpu_decode

    assert rows[1]["implementation"] == {"fast_step": "cpu_kernel" if cpu_decode.available() else "torch",
                                         "compact_dtype": "float32"}
    assert "implementation" not in rows[0]
    # the sequential form still works and counts the same tokens
    seq = time_native(engine, prompts, 12, "dense", {})
    assert seq["generated_tokens"] == rows[0]["generated_tokens"]


def test_transformers_baseline_times_its_decode_after_the_first_token(engine):
    """The transformers reference row comes from one `generate` run: the streamer marks the first
    new token, so prefill and decode are both positive and the tokens are counted."""
    from cotserve.bench.decode import time_hf_generate

    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    n = min(len(p) for p in prompts)
    row = time_hf_generate(engine, [p[:n] for p in prompts], 6)  # generate takes a rectangular batch
    assert row["policy"] == "transformers.generate" and row["generated_tokens"] == 12
    assert row["prefill_s"] > 0 and row["decode_s"] > 0 and row["decode_tok_s"] > 0
