"""`cotserve bench capacity`: how many requests vLLM runs at once, and how fast it finishes them,
under each policy with the same KV cache memory.

One vLLM engine (the cotserve plugin and `EvictingScheduler`, a fixed `kv_cache_memory_bytes`)
runs every row: for each policy, R requests of P random prompt tokens and N new tokens each (greedy,
`ignore_eos`) are added at once and stepped to the end. Reported per row: the scheduler's running
count after each `schedule()` (max, and mean over the steps while any request was unfinished), the
time to finish all R requests, the total generated tokens over that time (decode tok/s, prefill
included in the time), and the preemptions the scheduler made. A dense row holds every token's KV;
an eviction row (`skipkv`, `rkv`, `streamingllm`) returns blocks to vLLM's pool as it compacts,
so the scheduler admits more requests. `--model random:qwen3-4b` serves dummy weights of the real
shapes (vLLM's `load_format=dummy`).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from cotserve.bench.vllm_decode import (
    _params,
    emit,
    flush_telemetry,
    model_folder,
    replay_params,
    replay_setup,
    row_telemetry,
)
from cotserve.errors import CotserveError
from cotserve.jsonl import read_jsonl


def run_capacity_bench(policies: list[str], prompt_tokens: int, new_tokens: int, requests: int,
                       kv_cache_memory: int, model: str, policy_opt: dict[str, Any] | None, dtype: str = "auto",
                       max_num_seqs: int | None = None, max_num_batched_tokens: int = 16384,
                       enforce_eager: bool = False, seed: int = 0, replay: str | None = None,
                       data_dir: str | None = None) -> dict[str, Any]:
    """`replay`: a benchmark replay source (`cotserve.engine.replay`): every request's tokens follow
    that text, so sentences, thoughts and refreshes come at its rates."""
    if requests < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise CotserveError("--requests, --prompt-tokens and --new-tokens must be positive")
    if kv_cache_memory <= 0:
        raise CotserveError("--kv-cache-memory must be a positive number of bytes")
    tmp = Path(tempfile.mkdtemp(prefix="cotserve-capacity-"))
    stats_path, tele_path = tmp / "sched.txt", tmp / "telemetry.jsonl"
    stats_path.touch()
    tele_path.touch()
    from cotserve.vllm.settings import variable

    os.environ[variable("sched_stats")] = str(stats_path)  # before vLLM starts its processes
    os.environ[variable("telemetry")] = str(tele_path)
    import torch

    from cotserve.vllm.architectures import hf_overrides
    from cotserve.vllm.compat import LLM, SamplingParams

    max_len = prompt_tokens + new_tokens + 16
    folder, dummy = model_folder(model, max_len)
    seqs = max_num_seqs or min(requests, 256)
    kwargs: dict[str, Any] = dict(model=folder, dtype="bfloat16" if dtype == "auto" else dtype,
                                  enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=seqs,
                                  max_num_batched_tokens=max(max_num_batched_tokens, seqs), seed=seed,
                                  kv_cache_memory_bytes=kv_cache_memory, enforce_eager=enforce_eager,
                                  scheduler_cls="cotserve.vllm.scheduler.EvictingScheduler",
                                  async_scheduling=False)
    if dummy:
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    text = replay_setup(replay, kwargs, dummy, data_dir)
    kwargs["hf_overrides"] = hf_overrides(folder)  # cotserve's model classes (SkipKV's hidden states)
    if torch.cuda.is_available():
        kwargs["attention_backend"] = "CUSTOM"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab - 100, (prompt_tokens,), generator=gen).tolist() for _ in range(requests)]
    opts = dict(policy_opt or {})
    rows = []
    for pol in policies:  # warm-up: a short request through each policy
        _run(engine, [[1] * 64], replay_params(_params(SamplingParams, pol, opts, 4), text, f"warm-{pol}", 1),
             f"warm-{pol}")
    flush_telemetry(engine, SamplingParams)
    runtime_last: dict[str, Any] | None = None
    for pol in policies:
        s0, t_start = stats_path.stat().st_size, tele_path.stat().st_size
        res = _run(engine, prompts, replay_params(_params(SamplingParams, pol, opts, new_tokens), text, pol,
                                                  len(prompts)), f"{pol}")
        steps = _sched_steps(stats_path, s0)  # read before the flush: its steps are not the row's
        flush_telemetry(engine, SamplingParams)
        busy = [x for x in steps if x[0] + x[1] > 0]  # while any request was unfinished
        running = [x[0] for x in busy]
        lines = list(read_jsonl(tele_path, start=t_start))
        tele = [t for t in lines if str(t.get("request_id", "")).startswith(f"{pol}-")]
        runtime = [t["evict_runtime"] for t in lines if "evict_runtime" in t]
        row = {"policy": pol, "requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
               "running_max": max(running, default=0),
               "running_mean": round(sum(running) / len(running), 2) if running else 0.0,
               "steps": len(busy), "preemptions": (busy[-1][3] - steps[0][3]) if busy else 0, **res,
               "replay": text.source if text is not None else None, **row_telemetry(lines)}
        if tele:
            row["kv_entries_peak_max"] = max(t.get("kv_entries_peak", 0) for t in tele)
            row["recomputed"] = sum(t.get("recomputed", 0) for t in tele)
        if runtime and pol != "dense":  # the eviction runtime's cost in this row (cumulative counters)
            before = runtime_last or {}
            for k in ("plan_host_s", "compact_s", "compaction_steps", "compactions"):
                row[f"runtime_{k}"] = round(runtime[-1][k] - before.get(k, 0), 3)
        if runtime:
            runtime_last = runtime[-1]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from cotserve.vllm import compat

    dense = next((r for r in rows if r["policy"] == "dense"), None)
    if dense:
        for r in rows:
            r["running_mean_vs_dense"] = round(r["running_mean"] / max(dense["running_mean"], 1e-9), 2)
            r["running_max_vs_dense"] = round(r["running_max"] / max(dense["running_max"], 1), 2)
            r["finish_speedup_vs_dense"] = round(dense["finish_s"] / r["finish_s"], 2) if r["finish_s"] else None
    return {"bench": "capacity", "engine": "vllm", "model": model, "vllm": compat.version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "kv_cache_memory_bytes": kv_cache_memory, "max_num_seqs": seqs, "policy_opt": opts,
            "startup_s": round(startup, 1), "rows": rows,
            "replay": text.describe() if text is not None else None,
            "method": "R requests added at once to one vLLM engine per policy row; running = the scheduler's "
                      "running count after each schedule() (mean over the steps until the last request "
                      "finished); finish_s = time from adding the requests to the last token; tok/s = all "
                      "generated tokens / finish_s; same kv_cache_memory_bytes for every row"}


def _sched_steps(path: Path, start: int) -> list[tuple[int, ...]]:
    """(running, waiting, free blocks, preemptions so far) per scheduler step since byte `start`."""
    with open(path) as f:
        f.seek(start)
        return [tuple(int(x) for x in line.split()) for line in f if len(line.split()) == 4]


def _run(engine, prompts: list[list[int]], params: list, tag: str) -> dict[str, Any]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    counts = dict.fromkeys(ids, 0)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
    dt = time.perf_counter() - t0
    made = sum(counts.values())
    return {"finish_s": round(dt, 2), "generated_tokens": made, "tok_s": round(made / dt, 1) if dt > 0 else 0.0,
            "engine_steps": steps}


def main(argv: list[str] | None = None) -> None:
    """`python -m cotserve.bench.vllm_capacity` (the same as `cotserve bench capacity`, for machines
    without the CLI's dependencies)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="dense,skipkv")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=8 << 30)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--model", default="random:qwen3-4b")
    ap.add_argument("--policy-opt", action="append", default=[])
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--replay", default=None, help="benchmark replay source: 'math' or a JSONL/text file")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    from cotserve.policies.registry import parse_options

    report = run_capacity_bench([p for p in a.policy.split(",") if p], a.prompt_tokens, a.new_tokens, a.requests,
                                a.kv_cache_memory, a.model, parse_options(a.policy_opt),
                                max_num_seqs=a.max_num_seqs, enforce_eager=a.enforce_eager, replay=a.replay,
                                data_dir=a.data_dir)
    emit(report, a.json)


if __name__ == "__main__":
    main()
