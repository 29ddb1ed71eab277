"""`cotserve bench decode --engine vllm`: decode throughput of vLLM with and without SFI.

One engine serves every row of a run (dense and SFI requests through the same engine, on the same
prompts); `--no-plugin` starts stock vLLM (no cotserve plugin loaded at all) for the same rows.
Decode tok/s counts the tokens generated after every request of the batch has its first token
(the prompts are prefilled, chunked, before that point) over the time from that point to the
last token: slow steps, refreshes and the selector are inside that time. Prefix caching is off.
`--model random:qwen3-4b` serves dummy weights of the real shapes (vLLM's `load_format=dummy`).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError
from cotserve.jsonl import read_jsonl

QWEN3_ARCH = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def model_folder(model: str, max_len: int) -> tuple[str, bool]:
    """(folder, dummy weights?) for vLLM; random weights' positions reach `max_len` (Qwen3 reaches
    131k with YaRN)."""
    folder, dummy = _model_folder(model)
    if dummy:
        cfg_path = Path(folder) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
        cfg_path.write_text(json.dumps(cfg))
    return folder, dummy


def replay_setup(replay: str | None, kwargs: dict[str, Any], dummy: bool, data_dir: str | None = None):
    """Benchmark replay for a vLLM bench (`cotserve.engine.replay`): the text's token stream, with
    the engine started to accept it; random weights get the bundled model's tokenizer, so that the
    text has a vocabulary and the plugin sees its sentence boundaries. None when off."""
    if not replay:
        return None
    from transformers import AutoTokenizer

    from cotserve.engine.replay import ENV, load_replay, replay_path

    replay_path(replay, data_dir)  # a missing source fails before vLLM starts
    if dummy:
        from cotserve.models import resolve_model

        kwargs.update(tokenizer=str(resolve_model("smollm2-135m-instruct")), skip_tokenizer_init=False)
    tok = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or kwargs["model"])
    os.environ[ENV] = "1"  # before vLLM starts its processes
    return load_replay(replay, tok, data_dir)


def replay_params(params, replay, tag: str, n: int) -> list:
    """One request's params per prompt: each with its own part of the replayed text."""
    if replay is None:
        return [params] * n
    out = []
    for i in range(n):
        p = params.clone()
        p.extra_args = {**(p.extra_args or {}), "cotserve_replay": replay.tokens(f"{tag}-{i}", p.max_tokens)}
        out.append(p)
    return out


def emit(report: dict[str, Any], path: str | None) -> None:
    """Print the report as JSON, and write it to `path` when given."""
    text = json.dumps(report, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)


def _model_folder(model: str) -> tuple[str, bool]:
    """(folder, dummy weights?) for vLLM."""
    if model.startswith("random:"):
        from cotserve.models import RANDOM_SHAPES

        shape = model.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise CotserveError(f"unknown random shape {shape!r} (known: {', '.join(RANDOM_SHAPES)})")
        cfg = dict(RANDOM_SHAPES[shape])
        cfg["architectures"] = [QWEN3_ARCH[cfg["model_type"]]]
        cfg["torch_dtype"] = "bfloat16"
        folder = Path(tempfile.mkdtemp(prefix=f"cotserve-{shape}-"))
        (folder / "config.json").write_text(json.dumps(cfg))
        return str(folder), True
    from cotserve.models import resolve_model

    return str(resolve_model(model)), False


def run_vllm_decode_bench(policies: list[str], contexts: list[int], batches: list[int], new_tokens: int,
                          model: str, policy_opt: dict[str, Any] | None, plugin: bool, dtype: str = "auto",
                          gpu_memory_utilization: float = 0.75, enforce_eager: bool = False,
                          seed: int = 0, replay: str | None = None, data_dir: str | None = None) -> dict[str, Any]:
    """`replay`: a benchmark replay source (`cotserve.engine.replay`): every request's tokens follow
    that text, so SFI's refreshes come at its sentence boundaries."""
    if len(contexts) != len(batches):
        raise CotserveError("--context and --batch need the same number of values (one row per pair)")
    if not plugin and any(p != "dense" for p in policies):
        raise CotserveError("--no-plugin runs stock vLLM: only the dense policy exists there")
    if not plugin:
        os.environ["VLLM_PLUGINS"] = "none"  # before vLLM starts its processes: no cotserve plugin at all
    tele_path = Path(tempfile.mkstemp(prefix="cotserve-sfi-", suffix=".jsonl")[1])
    from cotserve.vllm.settings import variable

    os.environ[variable("telemetry")] = str(tele_path)
    import torch

    from cotserve.vllm.architectures import hf_overrides
    from cotserve.vllm.compat import LLM, SamplingParams

    max_len = max(contexts) + new_tokens + 16
    folder, dummy = model_folder(model, max_len)
    kwargs: dict[str, Any] = dict(model=folder, dtype="bfloat16" if dtype == "auto" else dtype,
                                  enable_prefix_caching=False, max_model_len=max_len,
                                  max_num_seqs=max(batches), max_num_batched_tokens=65536, seed=seed,
                                  gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager)
    if dummy:
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    text = replay_setup(replay, kwargs, dummy, data_dir)
    if plugin:
        kwargs["hf_overrides"] = hf_overrides(folder)  # cotserve's model classes
    sfi_slots = None
    if plugin and torch.cuda.is_available():
        kwargs["attention_backend"] = "CUSTOM"
        # a slot for every request of the largest batch from its first token, whatever the card's memory
        # (the default sizes the slots by memory: a request beyond them would decode densely at first)
        sfi_slots = os.environ.setdefault(variable("sfi_slots"), str(max(batches)))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(seed)
    opts = dict(policy_opt or {})
    rows = []
    # warm-up: a short batch through each policy
    for pol in policies:
        _decode(engine, [[1] * 64], replay_params(_params(SamplingParams, pol, opts, 4), text, f"warm-{pol}", 1),
                f"warm-{pol}")
    flush_telemetry(engine, SamplingParams)
    for ctx, bsz in zip(contexts, batches, strict=True):
        prompts = [torch.randint(100, vocab - 100, (ctx,), generator=gen).tolist() for _ in range(bsz)]
        for pol in policies:
            start = tele_path.stat().st_size
            tag = f"{pol}-{ctx}-{bsz}"
            res = _decode(engine, prompts, replay_params(_params(SamplingParams, pol, opts, new_tokens + 1), text,
                                                         tag, bsz), tag)
            flush_telemetry(engine, SamplingParams)
            tele = list(read_jsonl(tele_path, start=start))
            row = {"policy": pol, "context": ctx, "batch": bsz, "new_tokens": new_tokens, **res,
                   "engine": "vllm" + ("" if plugin else " (stock, no plugin)"),
                   "replay": text.source if text is not None else None}
            tele = [t for t in tele if t.get("tag", "").startswith(tag)] or tele
            row.update(row_telemetry(tele))
            if pol != "dense" and tele:
                row["refresh_host_s"] = tele[-1].get("runtime_refresh_host_s")
            rows.append(row)
            print(json.dumps(row), flush=True)
    from cotserve.vllm import compat

    by = {(r["context"], r["batch"]): {} for r in rows}
    for r in rows:
        by[(r["context"], r["batch"])][r["policy"]] = r["decode_tok_s"]
    for r in rows:
        dense = by[(r["context"], r["batch"])].get("dense")
        if dense:
            r["vs_dense"] = round(r["decode_tok_s"] / dense, 3)
    return {"bench": "decode", "engine": "vllm", "plugin": plugin, "model": model, "vllm": compat.version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "policy_opt": opts, "startup_s": round(startup, 1), "rows": rows,
            "sfi_slots": sfi_slots,
            "replay": text.describe() if text is not None else None,
            "method": "decode tok/s = tokens generated after every request has its first token / time from "
                      "then to the last token; prefix caching off; max_num_batched_tokens 65536"}


def flush_telemetry(engine, cls) -> None:
    """One tiny dense request: the plugin writes a finished request's telemetry at the step after
    it ended, so this makes the last row's lines land before the next row starts."""
    engine.add_request("flush", {"prompt_token_ids": [1] * 8}, cls(max_tokens=1, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()


def row_telemetry(tele: list[dict[str, Any]]) -> dict[str, Any]:
    """What a row ran with, averaged over its requests' telemetry lines: SFI's slow-step and
    retained ratios, eviction's compactions (None where the row has no such policy)."""
    def mean(key: str):
        vals = [t[key] for t in tele if isinstance(t.get(key), (int, float))]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {"sfi_slow_step_ratio": mean("sfi_slow_step_ratio"), "sfi_retained_ratio": mean("sfi_retained_ratio"),
            "compactions_mean": mean("compactions")}


def _params(cls, policy: str, opts: dict[str, Any], max_tokens: int):
    extra = None
    if policy != "dense":
        extra = {"cotserve": {"policy": policy, "options": {k.split(".", 1)[-1]: v for k, v in opts.items()}}}
    return cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra, detokenize=False)


def _decode(engine, prompts: list[list[int]], params: list, tag: str) -> dict[str, Any]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    counts = dict.fromkeys(ids, 0)
    t_start = time.perf_counter()
    t_first = None
    at_first = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
        if t_first is None and all(c >= 1 for c in counts.values()):
            t_first = time.perf_counter()
            at_first = sum(counts.values())
    t_end = time.perf_counter()
    made = sum(counts.values()) - at_first
    dt = t_end - (t_first or t_start)
    return {"prefill_s": round((t_first or t_end) - t_start, 3), "decode_s": round(dt, 4), "decode_tokens": made,
            "decode_tok_s": round(made / dt, 2) if dt > 0 else 0.0}


def main(argv: list[str] | None = None) -> None:
    """`python -m cotserve.bench.vllm_decode` (the same as `cotserve bench decode --engine vllm`, for
    machines without the CLI's dependencies)."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="dense,sfi")
    ap.add_argument("--context", default="8192")
    ap.add_argument("--batch", default="16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--model", default="random:qwen3-4b")
    ap.add_argument("--policy-opt", action="append", default=[])
    ap.add_argument("--no-plugin", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.75)
    ap.add_argument("--json", default=None)
    ap.add_argument("--replay", default=None, help="benchmark replay source: 'math' or a JSONL/text file")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16), float32, bfloat16 or float16")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    from cotserve.policies.registry import parse_options

    report = run_vllm_decode_bench([p for p in a.policy.split(",") if p], [int(x) for x in a.context.split(",")],
                                   [int(x) for x in a.batch.split(",")], a.new_tokens, a.model,
                                   parse_options(a.policy_opt), plugin=not a.no_plugin,
                                   gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                                   replay=a.replay, data_dir=a.data_dir, dtype=a.dtype)
    emit(report, a.json)


if __name__ == "__main__":
    main()
