"""`cotserve bench fidelity --engine vllm`: how closely a policy follows dense decoding on vLLM with
cotserve's plugin (on a GPU: its CUDA backend and kernels), on the same texts as the native bench
(`cotserve.bench.fidelity`), so the two engines' numbers sit side by side.

Teacher forcing on vLLM is the benchmark replay (`cotserve.vllm.replay`): each request's next
token is forced to the text's, while vLLM reports the model's own log-probabilities of that step
(`logprobs_mode` raw: before any logits processor, the forcing included). vLLM returns the top
`top` (at most its `max_logprobs`, 20) log-probs per step, not the whole distribution, so:

* top-1 agreement: fraction of steps where the policy's most likely token equals dense's (exact);
* top-K KL: KL(dense || policy) between the two distributions restricted to dense's top K tokens
  and renormalized there (so it is >= 0 and 0 only where they agree on that set), a token missing
  from the policy's top K taking the policy's K-th log-prob: a measure from the head of the
  distribution, not the native bench's full-vocabulary KL.
"""

from __future__ import annotations

import math
import os
from typing import Any

from cotserve.bench.decode import _options_for
from cotserve.bench.fidelity import interval
from cotserve.errors import CotserveError

TOP = 20  # vLLM's default max_logprobs


def step_compare(dense: dict[int, float], policy: dict[int, float]) -> tuple[bool, float]:
    """(same top-1, top-K KL term) of one step from the two top-K log-prob maps (token -> log-prob)."""
    same = max(dense, key=dense.__getitem__) == max(policy, key=policy.__getitem__)
    floor = min(policy.values())
    tokens = list(dense)
    p = _normalized([dense[t] for t in tokens])
    q = _normalized([policy.get(t, floor) for t in tokens])
    return same, max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True)))


def _normalized(logprobs: list[float]) -> list[float]:
    """Log-probs renormalized over the given tokens."""
    top = max(logprobs)
    lse = top + math.log(sum(math.exp(x - top) for x in logprobs))
    return [x - lse for x in logprobs]


def compare_runs(reference: list[list[dict[int, float]]], results: list[list[dict[int, float]]]) -> dict[str, Any]:
    """Top-1 agreement and mean top-K KL over every step of every prompt, and per prompt."""
    per_top1, per_kl = [], []
    for ref, res in zip(reference, results, strict=True):
        pairs = [step_compare(d, p) for d, p in zip(ref, res, strict=True)]
        per_top1.append(sum(s for s, _ in pairs) / len(pairs))
        per_kl.append(sum(k for _, k in pairs) / len(pairs))
    steps = [len(r) for r in reference]
    total = sum(steps)
    return {"top1_agreement": round(sum(a * n for a, n in zip(per_top1, steps, strict=True)) / total, 5),
            "topk_kl": round(sum(k * n for k, n in zip(per_kl, steps, strict=True)) / total, 6),
            "top1_per_prompt": [round(a, 5) for a in per_top1], "top1_interval": interval(per_top1),
            "topk_kl_per_prompt": [round(k, 6) for k in per_kl]}


def teacher_forced(llm, prompts: list[list[int]], forced: list[list[int]], policy: str, options: dict[str, Any],
                   top: int = TOP) -> list[list[dict[int, float]]]:
    """Each prompt decoded for len(forced[i]) steps with the text's tokens forced; per step the
    model's top `top` log-probs (token -> log-prob). Raises if a step's token is not the text's."""
    from cotserve.vllm.compat import SamplingParams

    params = []
    for ids in forced:
        extra: dict[str, Any] = {"cotserve_replay": list(ids)}
        if policy != "dense":
            extra["cotserve"] = {"policy": policy, "options": options}
        params.append(SamplingParams(max_tokens=len(ids), temperature=0.0, ignore_eos=True, logprobs=top,
                                     detokenize=False, extra_args=extra))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for out, ids in zip(outs, forced, strict=True):
        got = out.outputs[0]
        if list(got.token_ids) != list(ids):
            raise CotserveError(f"request {out.request_id}: the forced tokens were not followed (replay off?)")
        # vLLM adds the sampled (here: forced) token to the top K when it is not among them: keep the top K
        rows.append([{t: lp.logprob for t, lp in step.items() if lp.rank is not None and lp.rank <= top}
                     for step in got.logprobs])
    return rows


def run_vllm_fidelity_bench(policies: list[str], context: int, steps: int, batch: int, policy_opt: list[str] | None,
                            policy_file: str | None, model: str, data_dir: str | None, dtype: str = "auto",
                            gpu_memory_utilization: float = 0.75, enforce_eager: bool = False,
                            random_tokens: bool = False, top: int = TOP, keep_reference: bool = False
                            ) -> dict[str, Any]:
    """`policies`: rows as `bench.specs` reads them, compared with dense on the texts the native
    bench uses (`long_prompts_with_source`, the model's own tokenizer). `keep_reference`: the report
    also holds dense's top-1 token per step and prompt (`reference_top1`), to set beside another
    engine's."""
    from cotserve.bench.prompts import long_prompts_with_source
    from cotserve.bench.specs import parse_rows
    from cotserve.bench.vllm_decode import model_folder
    from cotserve.policies.registry import build_policy, parse_options

    if not 1 <= top <= TOP:
        raise CotserveError(f"--top must be 1..{TOP} (vLLM's max_logprobs), got {top}")
    options = parse_options(policy_opt, policy_file)
    specs = parse_rows(policies)
    runs = [(s.label, s.policy, {**_options_for(s.policy, options), **s.options}) for s in specs]
    from cotserve.vllm.batch_rows import request_policy_of

    for _, p, opts in runs:  # what the plugin refuses fails here, before vLLM starts
        request_policy_of({"cotserve": {"policy": p, "options": opts}})
    folder, dummy = model_folder(model, context + steps + 16)
    if dummy:
        raise CotserveError("fidelity needs real weights: random weights agree with nothing")
    import torch

    from cotserve.engine.replay import ENV
    from cotserve.vllm import compat
    from cotserve.vllm.architectures import hf_overrides

    os.environ[ENV] = "1"  # before vLLM starts its processes: the forcing is accepted
    kwargs: dict[str, Any] = dict(model=folder, dtype="bfloat16" if dtype == "auto" else dtype,
                                  enable_prefix_caching=False, max_model_len=context + steps + 16,
                                  max_num_seqs=max(1, batch), gpu_memory_utilization=gpu_memory_utilization,
                                  enforce_eager=enforce_eager, hf_overrides=hf_overrides(folder), seed=0,
                                  # the eviction policies' scheduler (it runs synchronously, as they need)
                                  scheduler_cls="cotserve.vllm.scheduler.EvictingScheduler", async_scheduling=False)
    if torch.cuda.is_available():
        kwargs["attention_backend"] = "CUSTOM"
        from cotserve.vllm.settings import variable

        # every request holds a slot from its first token (compared with the native policy's steps)
        os.environ.setdefault(variable("sfi_slots"), str(max(1, batch)))
    llm = compat.LLM(**kwargs)
    texts, source = long_prompts_with_source(llm.get_tokenizer(), context + steps, batch, data_dir,
                                             random_tokens=random_tokens)
    prompts, forced = [t[:context] for t in texts], [t[context : context + steps] for t in texts]
    reference = teacher_forced(llm, prompts, forced, "dense", {}, top)
    rows = []
    for label, p, opts in runs:
        results = teacher_forced(llm, prompts, forced, p, opts, top)
        rows.append({"row": label, "policy": build_policy(p, opts).name, "options": opts,
                     **compare_runs(reference, results)})
    report: dict[str, Any] = {
        "bench": "fidelity", "engine": "vllm", "vllm": compat.version(), "model": model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": kwargs["dtype"], "context": context, "steps": steps, "batch": batch, "forced": "text",
        "text_source": source.describe(), "logprobs": f"vLLM raw log-probs, top {top} per step", "results": rows}
    if keep_reference:
        report["reference_top1"] = [[max(m, key=m.__getitem__) for m in ref] for ref in reference]
    return report
