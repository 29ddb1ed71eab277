"""`cotserve bench decode`: decode throughput of policies on the same prompts, in one run (by
default their decode steps interleaved, one step of each in turn), plus transformers' own
`generate` on the same input as a reference point."""

from __future__ import annotations

import platform
import resource
import time
from typing import Any

import torch

from cotserve.bench.progress import Progress
from cotserve.engine.native import GenRequest, NativeEngine
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import CotserveError
from cotserve.models import load_model
from cotserve.policies.options import SFIOptions, option_default
from cotserve.policies.registry import build_policy, parse_options


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _requests(prompts: list[list[int]], n: int, forced: list[list[int]] | None = None) -> list[GenRequest]:
    """One request per prompt, `n` tokens each (ignore_eos); `forced`: each one's replayed tokens."""
    return [GenRequest(p, SamplingParams(max_tokens=n, ignore_eos=True),
                       forced_ids=None if forced is None else forced[i][:n]) for i, p in enumerate(prompts)]


def time_native(engine: NativeEngine, prompts: list[list[int]], new_tokens: int, policy: str,
                options: dict[str, Any], forced: list[list[int]] | None = None) -> dict[str, Any]:
    stack = build_policy(policy, options)
    reqs = _requests(prompts, new_tokens, forced)
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(dev)
    first_token_at = None
    t0 = time.perf_counter()
    results = []
    for deltas in engine.stream(reqs, stack):
        if first_token_at is None:
            _sync(dev)
            first_token_at = time.perf_counter()
        results.extend(d.result for d in deltas if d.result is not None)
    _sync(dev)
    out = _row(stack.name, first_token_at - t0, time.perf_counter() - first_token_at, results)
    _describe(out, stack)
    if dev.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def time_continuous(engine: NativeEngine, prompts: list[list[int]], new_tokens: int, policy: str,
                    options: dict[str, Any], static_step: bool | None = None,
                    forced: list[list[int]] | None = None) -> dict[str, Any]:
    """The same prompts through the continuous engine (`--scheduler continuous`): one pool of
    len(prompts) slots, every prompt prefilled in the first step, then decode steps until all
    finish. `static_step`: the engine's switch (None: the pooled step captured in CUDA graphs on
    CUDA, the eager step elsewhere; False: the eager step). A short warm-up round of the same batch
    size runs first, so the timed steps do not include the graphs' capture."""
    from cotserve.engine.continuous import ContinuousEngine

    # the pool's SFI buffers hold the k the run asks for (the pooled form's capacity setting)
    k = option_default(SFIOptions, "k")
    k = int(options.get("k", options.get("sfi.k", k))) if "sfi" in policy.split("+") else k
    longest = max(len(p) for p in prompts)
    ce = ContinuousEngine(engine, slots=len(prompts), prefill_chunk=longest * len(prompts), static_step=static_step,
                          pool_len=longest + new_tokens + 1, pool_capacity={"sfi": k})
    dev = engine.device

    def submit(ps: list[list[int]], n: int) -> None:
        for r in _requests(ps, n, forced):
            ce.submit(r, policy, options)

    submit([p[:64] for p in prompts], 4)  # warm-up: the bucket's capture, kernel compilation
    for _ in ce.run():
        pass
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    submit(prompts, new_tokens)
    _sync(dev)
    t0 = time.perf_counter()
    first = ce.step()  # every prompt's prefill and first token
    _sync(dev)
    t_first = time.perf_counter()
    results = [d.result for d in first if d.result is not None]
    for deltas in ce.run():
        results.extend(d.result for d in deltas if d.result is not None)
    _sync(dev)
    out = _row(build_policy(policy, options).name, t_first - t0, time.perf_counter() - t_first, results,
               skip=("decode_s", "decode_tok_s", "queue_s", "ttft_s", "prefill_s"))
    out["scheduler"] = "continuous"
    out["decode_step"] = sorted({r.telemetry["decode_step"] for r in results})
    out["cuda_graph_captures"] = ce.pooled_step.captures if ce.static_step else 0
    if dev.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def _row(policy: str, prefill_s: float, decode_s: float, results: list, skip: tuple[str, ...] = ()
         ) -> dict[str, Any]:
    """One policy's result row: timings, tokens, KV bytes, peak RSS, and the numeric per-request
    telemetry averaged over the batch (`skip`: telemetry keys left out)."""
    gen = sum(r.completion_tokens for r in results)
    decode_tokens = gen - len(results)  # the first token of each comes from prefill
    tele = [r.telemetry for r in results]
    out: dict[str, Any] = {
        "policy": policy,
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "generated_tokens": gen,
        "decode_tok_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "kv_bytes_per_seq_after_prefill": max(t["kv_bytes_after_prefill"] for t in tele),
        "kv_bytes_per_seq_peak_decode": max(t["kv_bytes_peak"] for t in tele),
        "kv_bytes_per_seq_end": max(t["kv_bytes_final"] for t in tele),
        "kv_bytes_per_seq_allocated": max(t["kv_bytes_allocated"] for t in tele),
        "peak_rss_mb": round(_peak_rss_mb(), 1),  # the process's (interleaved: all policies' caches)
    }
    for key, val in tele[0].items():
        if isinstance(val, (int, float)) and not key.startswith("kv_bytes") and key not in skip:
            vals = [t[key] for t in tele if isinstance(t.get(key), (int, float))]
            out.setdefault("telemetry", {})[key] = round(sum(vals) / len(vals), 4)
    return out


def _describe(row: dict[str, Any], stack) -> None:
    """Add the policies' own account of how they ran (`Policy.describe`) to a result row."""
    info = {k: v for p in stack.parts for k, v in p.describe().items()}
    if info:
        row["implementation"] = info


class _FirstTokenClock:
    """A transformers streamer that notes when `generate` hands over its first new tokens (the
    first `put` is the prompt, the second the first generated step)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def time_hf_generate(engine: NativeEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers' generate (its own DynamicCache, SDPA) on the same prompts, greedy, in one
    run: prefill = until the first new token (noted by a streamer), decode = the rest. (Earlier
    versions subtracted a 1-token run from a full one, which carried the run-to-run noise of two
    long prefills into the decode time.)"""
    model = engine.model
    dev = engine.device
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)
    clock = _FirstTokenClock()
    _sync(dev)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=engine.eos_default(),
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock)
    _sync(dev)
    t_end = time.perf_counter()
    first = clock.first_token_at if clock.first_token_at is not None else t0
    decode_s = max(t_end - first, 1e-9)
    return {
        "policy": "transformers.generate",
        "prefill_s": round(first - t0, 4),
        "decode_s": round(decode_s, 4),
        "generated_tokens": new_tokens * len(prompts),
        "decode_tok_s": round((new_tokens - 1) * len(prompts) / decode_s, 3),
    }


def time_native_interleaved(engine: NativeEngine, prompts: list[list[int]], new_tokens: int,
                            runs: list[tuple[str, dict[str, Any]]], forced: list[list[int]] | None = None
                            ) -> tuple[list[dict[str, Any]], list[list]]:
    """Like `time_native` for several policies at once, interleaved: each policy's batch is
    prefilled in turn (timed alone), then their decode steps run round-robin, one step of each in
    turn, and each step is timed on its own. A drift of the machine's speed (a shared VM's memory
    bandwidth moves from minute to minute) then slows every policy alike instead of whichever ran
    during it. Returns the rows and each policy's `Completion`s. The engine's per-request
    `decode_s` / `decode_tok_s` telemetry spans the interleaved wall time, so those keys are left
    out of the rows' telemetry."""
    dev = engine.device
    state = []
    for policy, options in runs:
        stack = build_policy(policy, options)
        gen = engine.stream(_requests(prompts, new_tokens, forced), stack)
        _sync(dev)
        t0 = time.perf_counter()
        first = next(gen)  # prefill and the first token of each sequence
        _sync(dev)
        results = [d.result for d in first if d.result is not None]
        state.append({"stack": stack, "gen": gen, "results": results, "prefill_s": time.perf_counter() - t0,
                      "decode_s": 0.0, "done": False})
    while not all(st["done"] for st in state):
        for st in state:
            if st["done"]:
                continue
            t = time.perf_counter()
            try:
                deltas = next(st["gen"])
            except StopIteration:
                st["done"] = True
                continue
            _sync(dev)
            st["decode_s"] += time.perf_counter() - t
            st["results"].extend(d.result for d in deltas if d.result is not None)
    rows = [_row(st["stack"].name, st["prefill_s"], st["decode_s"], st["results"], skip=("decode_s", "decode_tok_s"))
            for st in state]
    for row, st in zip(rows, state, strict=True):
        _describe(row, st["stack"])
    return rows, [st["results"] for st in state]


def run_decode_bench(policies: list[str], context: int, batch: int, new_tokens: int,
                     policy_opt: list[str] | None, policy_file: str | None, model: str,
                     hf_baseline: bool, data_dir: str | None, device: str, dtype: str,
                     interleave: bool = True, random_tokens: bool = False, scheduler: str = "static",
                     static_step: bool | None = None, replay: str | None = None) -> dict[str, Any]:
    """`policies`: rows as `bench.specs` reads them (`dense`, `dense[kernel=torch]`, `sfi`, ...).
    `scheduler`: static (the native engine's batch, `NativeEngine.stream`) or continuous (the
    continuous engine, `time_continuous`, rows one after the other; `static_step` its switch).
    `replay`: a benchmark replay source (`cotserve.engine.replay`): every request's tokens follow
    that text (transformers' generate, which cannot replay, is then left out)."""
    if scheduler not in ("static", "continuous"):
        raise CotserveError(f"scheduler must be static or continuous (got {scheduler!r})")
    from cotserve.bench.prompts import long_prompts_with_source
    from cotserve.bench.specs import parse_rows

    options = parse_options(policy_opt, policy_file)
    specs = parse_rows(policies)
    runs = [(s.policy, {**_options_for(s.policy, options), **s.options}) for s in specs]
    for p, opts in runs:  # fail fast on a bad policy or option, before loading anything
        build_policy(p, opts)
    if replay:
        from cotserve.engine.replay import load_replay, replay_path

        replay_path(replay, data_dir)
    note = Progress("decode")
    engine = NativeEngine(load_model(model, device=device, dtype=dtype), max_batch=batch)
    prompts, source = long_prompts_with_source(engine.tokenizer, context, batch, data_dir, random_tokens=random_tokens)
    note(f"{model} loaded on {engine.device}; {len(runs)} row(s) of {batch} x ({context} + {new_tokens}) tokens")
    text = load_replay(replay, engine.tokenizer, data_dir) if replay else None
    forced = [text.tokens(i, new_tokens) for i in range(batch)] if text is not None else None
    # warm-up (allocator, kernels) so the first policy is not penalised
    time_native(engine, [p[:64] for p in prompts], 4, "dense", {})
    if scheduler == "continuous":
        rows = []
        for i, (p, opts) in enumerate(runs, 1):
            rows.append(time_continuous(engine, prompts, new_tokens, p, opts, static_step, forced))
            note(f"row {i}/{len(runs)} {p}: {rows[-1].get('decode_tok_s')} decode tok/s")
    elif interleave and len(runs) > 1:
        note(f"{len(runs)} rows interleaved step by step")
        rows, _ = time_native_interleaved(engine, prompts, new_tokens, runs, forced)
    else:
        rows = []
        for i, (p, opts) in enumerate(runs, 1):
            rows.append(time_native(engine, prompts, new_tokens, p, opts, forced))
            note(f"row {i}/{len(runs)} {p}: {rows[-1].get('decode_tok_s')} decode tok/s")
    for row, spec, (_, opts) in zip(rows, specs, runs, strict=True):
        row["row"] = spec.label
        row["options"] = opts
    # the reference: the first plain dense row (the best dense on the device), else the first row
    base = next((r for r in rows if r["row"] == "dense"), None) or next(
        (r for r in rows if r["policy"] == "dense"), None)
    if hf_baseline and text is None:
        hf = time_hf_generate(engine, prompts, new_tokens)
        hf["row"] = hf["policy"]
        hf["implementation"] = {"attention": "transformers sdpa"}
        rows.append(hf)
    ref = base or rows[0]
    for r in rows:
        if ref.get("decode_tok_s") and r.get("decode_tok_s"):
            r["ratio_to_dense"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 3)
    return {
        "bench": "decode",
        "model": model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "weight_dtype": str(engine.loaded.weight_dtype or engine.dtype).replace("torch.", ""),
        "context": context,
        "batch": batch,
        "new_tokens": new_tokens,
        "policy_options": options,
        "text_source": source.describe(),
        "replay": text.describe() if text is not None else None,
        "ratio_reference": ref.get("row"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "interleaved": bool(interleave and len(runs) > 1 and scheduler == "static"),
        "scheduler": scheduler,
        "static_step": static_step,
        "machine": platform.machine(),
        "results": rows,
    }


def _options_for(policy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options apply to the policies that know them; dense ignores them."""
    import dataclasses

    from cotserve.policies.registry import REGISTRY, _load_all

    _load_all()
    names = set(policy.split("+"))
    fields: set[str] = set()
    for n in names:
        if n in REGISTRY:
            fields |= {f.name for f in dataclasses.fields(REGISTRY[n].config_cls)}
    return {k: v for k, v in options.items()
            if ((k.partition(".")[0] in names) if "." in k else (k in fields))}
