"""The continuous engine's pooled, fixed-shape decode step (`cotserve/engine/pooled_decode.py`) on a
CPU, on the bundled model, float32, greedy. On CUDA the step is captured in one graph per batch
size bucket (tests/test_cuda_continuous.py); here `static_step=True` runs the very same step
eagerly: the pool, the persistent row tensors, the padding rows at the pad slot, the dense launch
over every slot, and SFI's paged kernel through TRITON_INTERPRET=1 (tests/conftest.py sets it).

The reference is today's eager continuous path (`static_step=False`: each sequence its own cache
and stack), itself tested against decoding alone in tests/test_continuous.py."""

from __future__ import annotations

import pytest

from cotserve.engine.continuous import ContinuousEngine
from cotserve.engine.native import GenRequest
from cotserve.engine.pooled_decode import buckets
from cotserve.engine.sampling import SamplingParams
from cotserve.kernels import sfi_paged

PROMPTS = ["The sky is blue because", "Hi there, my friend.", "Two prime numbers are",
           "A train leaves the station at nine", "My favourite colour is", "Water boils at"]
SFI = {"k": 4, "recent": 4, "max_interval": 2}  # sparse fast steps and a refresh every 2 steps


def _req(engine, prompt: str, n: int) -> GenRequest:
    return GenRequest(engine.encode_prompt(prompt, chat=False),
                      SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def _run(ce: ContinuousEngine, plan: dict[int, list[tuple[GenRequest, str, dict]]]) -> tuple[dict, list[int]]:
    """Submit plan[i] before step i; returns {request id: completion} and the running count per step."""
    results, running = {}, []

    def on_step(i: int) -> None:
        for req, policy, opts in plan.get(i, []):
            ce.submit(req, policy, opts)

    for deltas in ce.run(on_step):
        running.append(len(ce.running))
        for d in deltas:
            if d.result is not None:
                results[d.request_id] = d.result
    return results, running


def test_buckets_are_powers_of_two_up_to_the_pool():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(32) == [1, 2, 4, 8, 16, 32]


def test_dense_joining_a_running_batch_gives_the_tokens_of_decoding_alone(engine):
    """Sequences join at steps 0, 1, 3 and 4 and leave at their own lengths, so the batch grows
    and shrinks across buckets; each sequence's tokens are those it decodes alone in the same
    pooled step, and those of the eager path. Every batch size took the smallest bucket that holds
    it, with padding rows at the pad slot."""
    lengths = [6, 3, 5, 2, 4]

    def run(static: bool) -> tuple[dict, list[int], ContinuousEngine, list[GenRequest]]:
        ce = ContinuousEngine(engine, slots=6, prefill_chunk=8, static_step=static, pool_len=64)
        reqs = [_req(engine, PROMPTS[i], n) for i, n in enumerate(lengths)]
        plan = {0: [(reqs[0], "dense", {})], 1: [(reqs[1], "dense", {}), (reqs[2], "dense", {})],
                3: [(reqs[3], "dense", {})], 4: [(reqs[4], "dense", {})]}
        return (*_run(ce, plan), ce, reqs)

    got, running, ce, reqs = run(True)
    ref, _, _, ref_reqs = run(False)
    assert max(running) >= 3
    step = ce.pooled_step
    sizes = {n for n, _ in step.bucket_steps}
    assert {1, 2, 3} <= sizes  # the batch grew and shrank through several buckets
    for n, b in step.bucket_steps:
        assert b == min(x for x in step.buckets if x >= n)
    assert step.captures == 0 and not step.graphs  # a CPU: the same step, run eagerly
    assert sorted(step.pool.free) == list(range(6))  # every slot back in the pool
    for i, (r, rr) in enumerate(zip(reqs, ref_reqs, strict=True)):
        res, eager = got[r.request_id], ref[rr.request_id]
        assert res.telemetry["decode_step"] == "static" and eager.telemetry["decode_step"] == "eager"
        assert len(res.token_ids) == lengths[i]
        assert res.token_ids == eager.token_ids
        assert res.telemetry["kv_bytes_final"] == eager.telemetry["kv_bytes_final"]
    for i in (2, 4):  # joined a running batch: the tokens of decoding alone in the pooled step
        alone = ContinuousEngine(engine, slots=1, static_step=True, pool_len=64).generate(
            [_req(engine, PROMPTS[i], lengths[i])])[0]
        assert got[reqs[i].request_id].token_ids == alone.token_ids


@pytest.mark.skipif(not sfi_paged.HAVE_TRITON, reason="triton not installed")
def test_pooled_step_with_sfi_dense_and_an_eager_row_matches_the_eager_path(engine):
    """One run with a dense sequence decoding, an SFI sequence joining it (paged kernel, slow and
    fast steps, refreshes) and a StreamingLLM sequence, which cannot join the pooled step and
    decodes through the eager path in the same steps: every sequence's tokens are those of the
    eager continuous path, SFI's slow steps too."""
    n = 4  # three decode steps: a slow one (with its refresh) and fast ones
    evict = {"budget": 10}
    reqs = [_req(engine, PROMPTS[0], n + 2), _req(engine, PROMPTS[3], n), _req(engine, PROMPTS[2], n)]
    plan = {0: [(reqs[0], "dense", {})], 1: [(reqs[1], "sfi", SFI), (reqs[2], "streamingllm", evict)]}

    def run(static: bool):
        ce = ContinuousEngine(engine, slots=3, static_step=static, pool_len=64, pool_capacity={"sfi": 8})
        return _run(ce, plan)[0], ce

    (got, ce), (ref, _) = run(True), run(False)
    for r in reqs:
        assert got[r.request_id].token_ids == ref[r.request_id].token_ids
    assert [got[r.request_id].telemetry["decode_step"] for r in reqs] == ["static", "static", "eager"]
    sfi_got, sfi_ref = got[reqs[1].request_id].telemetry, ref[reqs[1].request_id].telemetry
    assert sfi_got["sfi_steps"] == sfi_ref["sfi_steps"] == n - 1
    assert sfi_got["sfi_slow_steps"] == sfi_ref["sfi_slow_steps"] >= 1
    assert sfi_got["sfi_selected_per_head"] == sfi_ref["sfi_selected_per_head"] == SFI["k"]
    pool = ce.pooled_step.pool
    assert "sfi" in pool.forms and not pool.forms["sfi"].states  # the SFI sequence left the pooled runtime


def test_cancel_frees_the_pool_slot_within_one_step(engine):
    ce = ContinuousEngine(engine, slots=1, static_step=True, pool_len=64)
    a, b = _req(engine, PROMPTS[0], 40), _req(engine, PROMPTS[1], 3)
    ce.submit(a)
    ce.submit(b)
    ce.step()
    ce.step()
    pool = ce.pooled_step.pool
    assert pool.free == [] and len(ce.waiting) == 1
    ce.cancel(a.request_id)
    deltas = ce.step()
    final = next(d for d in deltas if d.request_id == a.request_id)
    assert final.finish_reason == "cancelled" and len(final.result.token_ids) == 2
    assert [s.slot.req.request_id for s in ce.running] == [b.request_id]  # b took the slot in the same step
    assert ce.running[0].pool_slot == 0 and pool.free == []
    out = {}
    while not ce.idle:
        for d in ce.step():
            if d.result is not None:
                out[d.request_id] = d.result
    assert pool.free == [0]
    assert out[b.request_id].token_ids == ContinuousEngine(engine, slots=1).generate([_req(engine, PROMPTS[1], 3)])[0].token_ids


def test_sequences_the_pool_cannot_hold_decode_eagerly(engine):
    """Longer than a slot, or a policy the pooled step does not serve: the eager path."""
    ce = ContinuousEngine(engine, slots=2, static_step=True, pool_len=16)
    long_req, short_req = _req(engine, PROMPTS[0], 20), _req(engine, PROMPTS[1], 3)
    torch_req = _req(engine, PROMPTS[2], 3)
    res = ce.generate([long_req, short_req])
    assert [r.telemetry["decode_step"] for r in res] == ["eager", "static"]
    assert ce.generate([torch_req], "dense", {"kernel": "torch"})[0].telemetry["decode_step"] == "eager"
    assert ContinuousEngine(engine, slots=2).static_step is False  # a CPU: off unless asked


def test_bench_decode_times_the_continuous_engine_with_and_without_the_pooled_step(engine):
    """`bench decode --scheduler continuous`: one row per policy, the step the engine took."""
    from cotserve.bench.decode import time_continuous

    prompts = [engine.encode_prompt(p, chat=False) for p in PROMPTS[:2]]
    rows = [time_continuous(engine, prompts, 5, "dense", {}, static_step=s) for s in (True, False)]
    assert [r["decode_step"] for r in rows] == [["static"], ["eager"]]
    for r in rows:
        assert r["scheduler"] == "continuous" and r["cuda_graph_captures"] == 0
        assert r["generated_tokens"] == 10 and r["decode_tok_s"] > 0 and r["prefill_s"] > 0
        assert r["telemetry"]["batch_size"] == 2
