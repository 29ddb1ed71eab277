"""CUDA-only checks of the continuous engine's pooled decode step in CUDA graphs
(`cotserve/engine/pooled_decode.py`; skipped without a GPU): one capture per batch-size bucket (and
per SFI rows present), replays after that, and the tokens of the eager continuous path for
sequences that join and leave mid-run, dense and SFI. Random weights of SmolLM2-135M's shapes,
float32, greedy, as in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SFI = {"k": 32, "recent": 16, "max_interval": 5}


@pytest.fixture(scope="module")
def cuda_engine():
    from cotserve.engine.native import NativeEngine
    from cotserve.models import load_random_model

    return NativeEngine(load_random_model("smollm2-135m", device="cuda", dtype="float32"), max_batch=4)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in lengths]


def _run(ce, prompts: list[list[int]], new: list[int], joins: list[int], policies: list[str]) -> list:
    """Sequence i joins before step joins[i] with policy policies[i]; returns the completions in order."""
    from cotserve.engine.native import GenRequest
    from cotserve.engine.sampling import SamplingParams

    reqs = [GenRequest(p, SamplingParams(max_tokens=n, ignore_eos=True), record_logprobs=True)
            for p, n in zip(prompts, new, strict=True)]
    results = {}

    def on_step(i: int) -> None:
        for r, at, pol in zip(reqs, joins, policies, strict=True):
            if at == i:
                ce.submit(r, pol, SFI if pol == "sfi" else {})

    for deltas in ce.run(on_step):
        for d in deltas:
            if d.result is not None:
                results[d.request_id] = d.result
    return [results[r.request_id] for r in reqs]


def _agree(graphed: list, eager: list, tol: float) -> None:
    for a, b in zip(eager, graphed, strict=True):
        assert b.telemetry["decode_step"] == "cuda_graph" and a.telemetry["decode_step"] == "eager"
        assert a.token_ids == b.token_ids
        diff = float((a.logprobs.float() - b.logprobs.float()).abs().max())
        print(a.telemetry["policy"], "graph vs eager: max log-prob difference", diff)
        assert diff < tol


def test_dense_graphs_are_captured_once_per_bucket_and_match_the_eager_path(cuda_engine):
    """Five dense sequences through a pool of 4 slots: joining at steps 0, 0, 3, 6 and 9 and
    leaving at their own lengths, the batch passes through buckets 1, 2 and 4; a second run with the
    same schedule replays the graphs without capturing again."""
    from cotserve.engine.continuous import ContinuousEngine

    prompts = _prompts(1, [37, 80, 5, 120, 64])
    new, joins, policies = [24, 10, 18, 6, 14], [0, 0, 3, 6, 9], ["dense"] * 5
    ce = ContinuousEngine(cuda_engine, slots=4, pool_len=256)
    assert ce.static_step and ce.capture
    graphed = _run(ce, prompts, new, joins, policies)
    eager = _run(ContinuousEngine(cuda_engine, slots=4, static_step=False), prompts, new, joins, policies)
    _agree(graphed, eager, 1e-2)
    step = ce.pooled_step
    used = {b for _, b in step.bucket_steps}
    assert len(used) >= 2
    assert step.captures == len(step.graphs) == len(used)  # one capture per bucket used
    assert set(step.graphs) == {(b, ()) for b in used}  # dense rows alone: no pooled form's kind
    for n, b in step.bucket_steps:
        assert b == min(x for x in step.buckets if x >= n)
    captures = step.captures
    again = _run(ce, prompts, new, joins, policies)  # the same batch sizes: replays only
    assert step.captures == captures
    assert [r.token_ids for r in again] == [r.token_ids for r in graphed]
    assert sorted(step.pool.free) == list(range(4))


def test_sfi_joins_the_captured_step_and_matches_the_eager_policy(cuda_engine):
    """SFI rows beside dense rows in the captured step (the paged kernel, per-row flags; refreshes
    between replays), joining and leaving mid-run, against the eager continuous path (the eager
    SFI policy on CUDA: its torch form). Same tokens and slow steps; log-probs to float rounding
    (the paged kernel's float32 products run as TF32)."""
    from cotserve.engine.continuous import ContinuousEngine

    prompts = _prompts(2, [300, 170, 64, 90])
    new, joins, policies = [24, 20, 16, 12], [0, 0, 4, 7], ["sfi", "dense", "sfi", "dense"]
    ce = ContinuousEngine(cuda_engine, slots=4, pool_len=512)
    graphed = _run(ce, prompts, new, joins, policies)
    eager = _run(ContinuousEngine(cuda_engine, slots=4, static_step=False), prompts, new, joins, policies)
    _agree(graphed, eager, 5e-2)
    for i, pol in enumerate(policies):
        if pol == "sfi":
            a, b = eager[i].telemetry, graphed[i].telemetry
            assert a["sfi_slow_steps"] == b["sfi_slow_steps"] >= 2
            assert a["sfi_selected_per_head"] == b["sfi_selected_per_head"] == SFI["k"]
    step = ce.pooled_step
    assert any("sfi" in kinds for _, kinds in step.graphs)  # a graph with SFI's launches
    assert step.captures == len(step.graphs)
    captures = step.captures
    again = _run(ce, prompts, new, joins, policies)
    assert step.captures == captures
    assert [r.token_ids for r in again] == [r.token_ids for r in graphed]
    assert "sfi" in step.pool.forms and not step.pool.forms["sfi"].states
