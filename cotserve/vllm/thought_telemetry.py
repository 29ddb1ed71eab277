"""Thought counts and SFI's slow steps of a finished request from its tokens, for the telemetry
vLLM returns.

The scheduler holds every request's tokens; the counts come from the native policies' own thought
follower (`policies.thoughts`, `policies.steering.SlotThoughts`) run over them, which makes the same
decisions the worker made step by step: an eviction policy's `non_execution_thoughts` (every
output token), and steering's applications and mean alpha_t (the boundaries among the tokens that
were forwarded: every output token but the last sampled one).
"""

from __future__ import annotations

from typing import Any


def thought_telemetry(tokenizer, prompt_ids: list[int], output_ids: list[int], evict: Any = None,
                      steer: Any = None) -> dict[str, Any]:
    from cotserve.policies.boundaries import thought_delimiter_ids
    from cotserve.policies.steering import SlotThoughts, request_knobs, think_ids
    from cotserve.policies.thoughts import load_rules, thought_tracker

    out: dict[str, Any] = {}
    if tokenizer is None:
        return out
    delims = thought_delimiter_ids(tokenizer)
    if evict is not None and hasattr(evict.config, "thought_rules"):
        tracker = thought_tracker(tokenizer, delims, load_rules(evict.config.thought_rules))
        for t in output_ids:
            tracker.push(t)
        out["non_execution_thoughts"] = tracker.non_execution
    if steer is not None:
        cfg = steer.config
        knobs = request_knobs(cfg, None)
        th = SlotThoughts(tokenizer, delims, list(prompt_ids), think_ids(tokenizer), load_rules(cfg.thought_rules))
        n, alpha_sum = 0, 0.0
        for t in output_ids[:-1]:
            th._think(t)
            th.tracker.push(t)
            if knobs.enabled and th.tracker.at_boundary and th.region != "after":
                n += 1
                alpha_sum += knobs.alpha0 + knobs.gamma * th.tracker.non_execution
        out.update(steering_applications=n, steering_alpha_mean=round(alpha_sum / n, 6) if n else 0.0,
                   steering_non_execution=th.tracker.non_execution)
    return out


def sfi_step_telemetry(tokenizer, cfg, prompt_ids: list[int], output_ids: list[int]) -> dict[str, Any]:
    """SFI's decode and slow steps of a finished request, from its tokens: decode step t feeds
    output token t (every one but the last sampled one) and is slow when the refresh trigger
    (`policies.sfi.trigger`, the runtime's own) fires on the token before it. The retained ratio
    depends on what each refresh selected, so only the runtime's telemetry file holds it."""
    from cotserve.policies.boundaries import sentence_end_ids
    from cotserve.policies.sfi.trigger import RefreshTrigger

    ends = sentence_end_ids(tokenizer) if tokenizer is not None else frozenset()
    trigger = RefreshTrigger(cfg.trigger, cfg.min_gap, cfg.max_interval, cfg.cooldown, cfg.period)
    seq = list(prompt_ids) + list(output_ids)
    n = max(len(output_ids) - 1, 0)
    slow = sum(trigger.step(t, seq[len(prompt_ids) + t - 1] in ends) for t in range(n))
    return {"sfi_steps": n, "sfi_slow_steps": slow, "sfi_slow_step_ratio": round(slow / n, 4) if n else 0.0}
