"""SFI's paged runtime for the native engine (`cotserve/policies/sfi/graph.py`: the decode step
the engine captures in a CUDA graph) against the eager policy, on the bundled model, float32,
greedy. On a CPU it runs uncaptured, its Triton kernels through TRITON_INTERPRET=1; the CUDA graph
itself is checked in tests/test_cuda.py.

The options make every part act within a few tokens: a prompt of about 60 tokens of which sinks
4 + k 8 + recent 8 are read on a fast step, a refresh every 2 steps (slow steps and re-packs)."""

from __future__ import annotations

import pytest

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.kernels import sfi_paged
from cotserve.policies.registry import build_policy

pytestmark = pytest.mark.skipif(not sfi_paged.HAVE_TRITON, reason="triton not installed")

PROMPT = ("A train leaves the station at 9:00 and travels 60 miles per hour. A second train leaves the same "
          "station at 10:30 on the same track at 90 miles per hour. When does the second train catch up?")
OPTS = {"k": 8, "recent": 8, "max_interval": 2}


def test_paged_runtime_gives_the_eager_policys_tokens_and_reads(engine):
    ids = engine.encode_prompt(PROMPT)
    assert len(ids) > 50

    def run(stack):
        return engine.generate([GenRequest(ids, SamplingParams(max_tokens=6, ignore_eos=True))], stack)[0]

    eager_stack = build_policy("sfi", OPTS)
    paged_stack = build_policy("sfi", {**OPTS, "kernel": "paged"})
    eager, paged = run(eager_stack), run(paged_stack)
    assert paged_stack.parts[0].describe()["fast_step"] == "paged_triton"
    assert eager_stack.parts[0].describe()["fast_step"] != "paged_triton"
    assert paged.token_ids == eager.token_ids
    te, tp = eager.telemetry, paged.telemetry
    assert tp["sfi_steps"] == te["sfi_steps"] == 5
    assert tp["sfi_slow_steps"] == te["sfi_slow_steps"] >= 2  # the same trigger decisions
    assert tp["sfi_selected_per_head"] == te["sfi_selected_per_head"] == 8
    assert tp["sfi_retained_ratio"] < 0.75  # fast steps read a fraction of the history


def test_paged_runtime_refuses_what_it_does_not_implement(engine, caplog):
    """Fallback heads (an addition of ours) or a stack with eviction: the eager policy serves."""
    ids = engine.encode_prompt(PROMPT)
    stack = build_policy("sfi", {**OPTS, "kernel": "paged", "dense_heads": 0.1})
    with caplog.at_level("WARNING"):
        engine.generate([GenRequest(ids, SamplingParams(max_tokens=2, ignore_eos=True))], stack)
    assert stack.parts[0].describe()["fast_step"] != "paged_triton"
    assert "kernel=paged serves SFI alone" in caplog.text
