"""`cotserve bench fidelity`: how closely a policy follows dense decoding.

Each sequence is a long text built deterministically from MATH training problems and solutions
(`bench.prompts.long_prompts`, `context + steps` tokens): the first `context` tokens are the
prompt, and the `steps` decode steps are teacher-forced with the text's true next tokens, for dense
and for each policy alike (so both see the same history). At every step we compare the policy's
next-token distribution with dense's. `forced="greedy"` instead feeds dense's own greedy
continuation of the `context`-token prompt (an easier test: text the model itself finds likely).

* top-1 agreement: fraction of steps where the policy's argmax equals dense's;
* mean KL(dense || policy) of the next-token distributions (nats), from float32 log-probs;
* per prompt, the same two numbers, and over prompts their mean with a 95% interval (normal
  approximation, mean +- 1.96 sd / sqrt(n); the spread between texts, not only within one);
* the policy's own telemetry (retained ratio, slow-step ratio, skipped groups, KV bytes, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from cotserve.bench.decode import _options_for
from cotserve.bench.progress import Progress
from cotserve.engine.native import GenRequest, NativeEngine
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import CotserveError
from cotserve.models import load_model
from cotserve.policies.registry import build_policy, parse_options


def _run(engine: NativeEngine, prompts: list[list[int]], steps: int, policy: str, options: dict[str, Any],
         forced: list[list[int]] | None) -> list:
    stack = build_policy(policy, options)
    reqs = [GenRequest(p, SamplingParams(max_tokens=steps, ignore_eos=True), record_logprobs=True,
                       forced_ids=None if forced is None else forced[i]) for i, p in enumerate(prompts)]
    return engine.generate(reqs, stack)


def compare(reference: list, results: list) -> dict[str, Any]:
    agree, total, kls, per_prompt = 0, 0, [], []
    for ref, res in zip(reference, results, strict=True):
        n = min(len(ref.greedy_ids), len(res.greedy_ids))
        a = sum(int(x == y) for x, y in zip(ref.greedy_ids[:n], res.greedy_ids[:n], strict=True))
        agree += a
        total += n
        p = ref.logprobs[:n].float()
        q = res.logprobs[:n].float()
        kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
        kls.append(kl)
        per_prompt.append({"top1_agreement": round(a / max(n, 1), 4), "mean_kl": round(float(kl.mean()), 5)})
    kl = torch.cat(kls)
    out = {"top1_agreement": round(agree / max(total, 1), 4), "mean_kl": round(float(kl.mean()), 5),
           "max_kl": round(float(kl.max()), 4), "steps_compared": total}
    if len(per_prompt) > 1:
        out["per_prompt"] = per_prompt
        for key in ("top1_agreement", "mean_kl"):
            out[f"{key}_ci95"] = interval([r[key] for r in per_prompt])
    return out


def interval(values: list[float]) -> list[float]:
    """Mean +- 1.96 standard errors over independent prompts (normal approximation)."""
    t = torch.tensor(values, dtype=torch.float64)
    half = 1.96 * float(t.std(unbiased=True)) / len(values) ** 0.5 if len(values) > 1 else 0.0
    m = float(t.mean())
    return [round(m - half, 5), round(m + half, 5)]


def run_fidelity_bench(policies: list[str], context: int, steps: int, batch: int, policy_opt: list[str] | None,
                       policy_file: str | None, model: str, data_dir: str | None, device: str,
                       dtype: str, forced_mode: str = "text", random_tokens: bool = False) -> dict[str, Any]:
    """`policies`: rows as `bench.specs` reads them (`sfi`, `sfi[dense_heads=0.08]`, ...)."""
    from cotserve.bench.prompts import long_prompts_with_source
    from cotserve.bench.specs import parse_rows

    if forced_mode not in ("text", "greedy"):  # fail fast, before loading anything
        raise CotserveError(f"--forced must be 'text' or 'greedy' (got {forced_mode!r})")
    options = parse_options(policy_opt, policy_file)
    specs = parse_rows(policies)
    runs = [(s.policy, {**_options_for(s.policy, options), **s.options}) for s in specs]
    for p, opts in runs:
        build_policy(p, opts)
    note = Progress("fidelity")
    engine = NativeEngine(load_model(model, device=device, dtype=dtype), max_batch=batch)
    note(f"{model} loaded on {engine.device}; {len(specs)} row(s), {batch} prompt(s) of {context} + {steps} tokens")
    texts, source = long_prompts_with_source(engine.tokenizer, context + steps, batch, data_dir,
                                             random_tokens=random_tokens)
    prompts = [t[:context] for t in texts]
    if forced_mode == "text":
        forced = [t[context:] for t in texts]  # the true continuation of each text
        reference = _run(engine, prompts, steps, "dense", {}, forced)
    else:
        reference = _run(engine, prompts, steps, "dense", {}, None)
        forced = [r.token_ids for r in reference]
    note(f"dense reference decoded ({forced_mode} forcing)")
    rows = []
    for i, (spec, (p, opts)) in enumerate(zip(specs, runs, strict=True), 1):
        results = _run(engine, prompts, steps, p, opts, forced)
        row: dict[str, Any] = {"row": spec.label, "policy": build_policy(p, opts).name, "options": opts,
                               **compare(reference, results)}
        tele: dict[str, float] = {}
        for key in results[0].telemetry:
            vals = [r.telemetry[key] for r in results if isinstance(r.telemetry.get(key), (int, float))]
            if vals and key not in ("prefill_s", "decode_s", "decode_tok_s", "batch_size"):
                tele[key] = round(sum(vals) / len(vals), 4)
        row["telemetry"] = tele
        rows.append(row)
        note(f"row {i}/{len(specs)} {spec.label}: top-1 agreement {row['top1_agreement']}, mean KL {row['mean_kl']}")
    return {"bench": "fidelity", "model": model, "device": str(engine.device),
            "dtype": str(engine.dtype).replace("torch.", ""),
            "weight_dtype": str(engine.loaded.weight_dtype or engine.dtype).replace("torch.", ""),
            "context": context, "steps": steps, "batch": batch,
            "forced": forced_mode, "text_source": source.describe(), "logprobs": "float32",
            "policy_options": options, "torch": torch.__version__, "results": rows}
