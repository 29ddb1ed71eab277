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
    assert rows[0]["implementation"] == {"dense_step": "cpu_kernel" if cpu_decode.available() else "torch"}
    # KV memory: allocated is the cache block a slot holds (capacity x layers x K/V), the peak the
    # most entries filled; dense fills what it allocates up to the last step's unwritten entry
    info = engine.info
    per_entry = 2 * info.num_kv_heads * info.head_dim * 4 * info.num_layers
    longest = max(len(p) for p in prompts)
    assert rows[0]["kv_bytes_per_seq_allocated"] == (longest + 12 + 1) * per_entry
    assert rows[0]["kv_bytes_per_seq_peak_decode"] == (longest + 11) * per_entry
    assert rows[0]["kv_bytes_per_seq_after_prefill"] == longest * per_entry
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


def test_bench_decode_reports_ratios_against_the_kernel_dense_and_eviction_peaks(engine, data_dir):
    """run_decode_bench end to end: the reference row is plain `dense` (whatever its position),
    every ratio is decode tok/s over that row's, the text source is recorded, and an eviction
    policy's peak counts the entries held BEFORE its compaction (one over the budget + interval
    bound it compacts back to), while its allocation is what it asked the engine for."""
    from cotserve.bench.decode import run_decode_bench

    rep = run_decode_bench(["rkv[budget=48,interval=8,window=4],dense[kernel=torch],dense"], context=64, batch=2,
                           new_tokens=17, policy_opt=None, policy_file=None, model="smollm2-135m-instruct",
                           hf_baseline=False, data_dir=str(data_dir), device="cpu", dtype="float32")
    rows = {r["row"]: r for r in rep["results"]}
    assert rep["ratio_reference"] == "dense" and rep["text_source"]["kind"] == "text"
    ref = rows["dense"]["decode_tok_s"]
    for r in rows.values():
        assert r["ratio_to_dense"] == round(r["decode_tok_s"] / ref, 3)
    assert rows["dense[kernel=torch]"]["implementation"] == {"dense_step": "torch"}
    info = engine.info
    per_entry = 2 * info.num_kv_heads * info.head_dim * 4 * info.num_layers
    ev = rows["rkv[budget=48,interval=8,window=4]"]
    # prompt of 64 > budget: the prefill peak is the whole prompt, before the prefill compaction
    assert ev["kv_bytes_per_seq_peak_decode"] == 64 * per_entry
    assert ev["kv_bytes_per_seq_after_prefill"] == 48 * per_entry
    # allocation: max(prompt, budget + interval) entries (the prompt is written before it is compacted)
    assert ev["kv_bytes_per_seq_allocated"] == 64 * per_entry
    assert ev["telemetry"]["kv_entries_peak"] == 64 and ev["telemetry"]["kv_entries_allocated"] == 64


def test_bench_decode_with_replay_runs_on_the_texts_tokens(engine, data_dir, tmp_path):
    """`--replay`: every row decodes the replayed text (the same tokens for every policy, none the
    model's greedy choice), SFI's slow-step ratio is the text's boundary rate, the report names
    the source, and transformers' generate (which cannot replay) is left out."""
    from cotserve.bench.decode import run_decode_bench
    from cotserve.bench.prompts import long_prompts
    from cotserve.engine.replay import load_replay
    from cotserve.policies.boundaries import sentence_end_ids

    src = tmp_path / "text.txt"
    src.write_text("We add the two numbers. The sum is even. Then we divide by two, and check it. " * 30)
    rep = run_decode_bench(["dense", "sfi[k=16,recent=8,max_interval=100000,dense_heads=0]"], context=64, batch=2,
                           new_tokens=33, policy_opt=None, policy_file=None, model="smollm2-135m-instruct",
                           hf_baseline=True, data_dir=str(data_dir), device="cpu", dtype="float32",
                           interleave=False, replay=str(src))
    text = load_replay(str(src), engine.tokenizer)
    assert rep["replay"] == {"source": "text.txt", "tokens": len(text.ids)}
    assert [r["row"] for r in rep["results"]] == ["dense", "sfi[k=16,recent=8,max_interval=100000,dense_heads=0]"]
    sfi = rep["results"][1]["telemetry"]
    ends = sentence_end_ids(engine.tokenizer)
    # decode steps 1..32 feed tokens 0..31; a step fires when the token before its input ended a
    # sentence (the prompt's last token for the first): the text's rate, averaged over the two prompts
    prompts = long_prompts(engine.tokenizer, 64, 2, str(data_dir))
    steps = [sum(t in ends for t in [p[-1], *text.tokens(i, 33)][:32]) for i, p in enumerate(prompts)]
    assert sfi["sfi_slow_steps"] == sum(steps) / 2 and sfi["sfi_slow_steps"] >= 4

