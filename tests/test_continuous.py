"""Continuous batching (`cotserve/engine/continuous.py`) on the bundled model, float32, greedy.

The reference is the static engine running a sequence alone (`NativeEngine.generate` with a
batch of one): chunked prefill beside a decoding sequence, cancellation, seeds and errors, and an
evicting sequence's memory handed back. A sequence joining a running batch, for every policy, is a
column of tests/test_policy_matrix.py."""

from __future__ import annotations

import pytest
import torch

from cotserve.engine.continuous import ContinuousEngine
from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import RequestError

NEW = 10
PROMPTS = ["The sky is blue because", "Hi there, my friend.", "Two prime numbers are"]

# the evicting policies' options (every policy joining a running batch: tests/test_policy_matrix.py)
EVICT = {"skipkv": {"budget": 10, "interval": 2, "window": 4}, "h2o": {"budget": 10}}


def _req(engine, prompt: str, n: int = NEW) -> GenRequest:
    return GenRequest(engine.encode_prompt(prompt, chat=False),
                      SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_chunked_prefill_interleaves_with_decode_and_matches_the_whole_prompt(engine):
    """A long prompt prefilled in chunks of 4 tokens while another sequence decodes: the running
    sequence gets a token at every step of the joining prefill, and both match decoding alone."""
    long_prompt = "Explain, in a few short sentences, how a rainbow forms after rain and why it is curved."
    ce = ContinuousEngine(engine, slots=2, prefill_chunk=4)
    runner, joiner = _req(engine, "Hi", n=12), _req(engine, long_prompt, n=4)
    per_step: list[set[str]] = []
    ce.submit(runner)
    ce.step()  # the runner's prefill (one chunk) and first token
    ce.submit(joiner)
    while not ce.idle:
        per_step.append({d.request_id for d in ce.step() if d.token_ids})
    chunks = -(-len(joiner.prompt_ids) // 4)
    assert chunks >= 4
    # while the joiner prefills (chunks - 1 steps without its token), the runner still streams
    assert all(runner.request_id in s for s in per_step[: chunks - 1])
    assert joiner.request_id not in set().union(*per_step[: chunks - 1])
    assert joiner.request_id in per_step[chunks - 1]
    ref = engine.generate([_req(engine, long_prompt, n=4)], "dense")[0].token_ids
    got = ContinuousEngine(engine, slots=2, prefill_chunk=4).generate([_req(engine, long_prompt, n=4)])[0]
    assert got.token_ids == ref


def test_cancel_frees_the_slot_for_a_waiting_request(engine):
    ce = ContinuousEngine(engine, slots=1)
    a, b = _req(engine, PROMPTS[0], n=50), _req(engine, PROMPTS[1], n=3)
    ce.submit(a)
    ce.submit(b)
    assert ce.free_slots() == 0
    ce.step()
    ce.step()
    assert [s.slot.req.request_id for s in ce.running] == [a.request_id] and len(ce.waiting) == 1
    ce.cancel(a.request_id)
    deltas = ce.step()
    final = next(d for d in deltas if d.request_id == a.request_id)
    assert final.finish_reason == "cancelled" and final.result is not None
    assert len(final.result.token_ids) == 2
    assert [s.slot.req.request_id for s in ce.running] == [b.request_id]  # b joined in the same step
    out = {}
    while not ce.idle:
        for d in ce.step():
            if d.result is not None:
                out[d.request_id] = d.result
    assert out[b.request_id].token_ids == engine.generate([_req(engine, PROMPTS[1], n=3)])[0].token_ids


def test_sampling_seeds_and_stop_and_errors(engine):
    """Seeded sampling is reproducible across neighbours; bad requests fail at submit, clearly."""
    ce = ContinuousEngine(engine, slots=4)
    seeded = GenRequest(engine.encode_prompt(PROMPTS[0]), SamplingParams(max_tokens=6, temperature=0.8, seed=7))
    alone = ce.generate([seeded])[0].token_ids
    again = GenRequest(engine.encode_prompt(PROMPTS[0]), SamplingParams(max_tokens=6, temperature=0.8, seed=7))
    other = _req(engine, PROMPTS[2], n=6)
    both = ce.generate([other, again])
    assert both[1].token_ids == alone
    with pytest.raises(RequestError):
        ce.submit(GenRequest([], SamplingParams(max_tokens=2)))
    with pytest.raises(Exception, match="policy"):
        ce.submit(_req(engine, "x"), "no-such-policy")
    with pytest.raises(ValueError):
        ContinuousEngine(engine, slots=2, prefill_chunk=0)
    assert ce.idle and torch.is_inference_mode_enabled() is False


@pytest.mark.parametrize("policy", ["skipkv", "h2o"])
def test_an_evicting_sequence_hands_back_its_prompts_memory(engine, policy):
    """A prompt longer than the budget is allocated whole at admission; once the cache has
    compacted below budget + interval the continuous engine reallocates it to that size, and the
    tokens stay those of decoding alone."""
    opts = EVICT[policy]
    prompt = " ".join(PROMPTS * 6)
    req = _req(engine, prompt, n=8)
    assert len(req.prompt_ids) > 3 * opts["budget"]
    got = ContinuousEngine(engine, slots=2).generate([req], policy, opts)[0]
    alone = engine.generate([_req(engine, prompt, n=8)], policy, opts)[0]
    assert got.token_ids == alone.token_ids
    t = got.telemetry
    per_entry = 2 * engine.info.num_layers * engine.info.num_kv_heads * engine.info.head_dim * 4  # float32 K+V
    assert t["kv_bytes_allocated_peak"] >= len(req.prompt_ids) * per_entry  # the whole prompt at admission
    assert t["kv_bytes_allocated"] < t["kv_bytes_allocated_peak"] / 2  # handed back
    assert t["kv_bytes_final"] <= t["kv_bytes_allocated"]
    assert t["kv_bytes_allocated"] < alone.telemetry["kv_bytes_allocated"]  # the static engine keeps it all
