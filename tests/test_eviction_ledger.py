"""The compaction schedule and block holes that vLLM's scheduler and worker both derive
(`cotserve.vllm.eviction_ledger`), and what the vLLM engine accepts per request."""

from __future__ import annotations

import pytest

from cotserve.errors import PolicyError
from cotserve.policies.registry import build_policy
from cotserve.vllm.batch_rows import request_policy_of
from cotserve.vllm.eviction_ledger import EvictionLedger, cdiv, live_blocks_cover


def _policy(name: str, **options):
    return build_policy(name, options).parts[0]


def _walk(ledger: EvictionLedger, steps: int, block_size: int) -> list[tuple[int, int, list[int]]]:
    """Decode `steps` tokens after the prefill; (decode step, entries before it, new holes) per compaction."""
    out = []
    for s in range(steps):
        before = ledger.prefill_len + s
        if ledger.due(before, 1):
            holes = ledger.compact(before, 1, block_size)
            out.append((s, ledger.physical(before), holes))
            n = cdiv(before + 1, block_size)
            live = ledger.live_blocks(n)
            assert len(live) * block_size >= ledger.physical(before + 1)  # the step's entry has a slot
            assert len(live) == n - len(ledger.holes)
    return out


def test_budget_eviction_compacts_after_the_prompt_then_every_interval():
    led = EvictionLedger(_policy("skipkv", budget=256, interval=128), prefill_len=1024)
    events = _walk(led, 511, block_size=128)
    assert [s for s, _, _ in events] == [0, 128, 256, 384]
    assert all(kept == 256 for _, kept, _ in events)
    assert led.evicted == 1024 + 384 - 256
    # the first compaction frees (1024 - 256) / 128 = 6 blocks, the later ones one each: the last live ones
    assert [len(h) for _, _, h in events] == [6, 1, 1, 1]
    assert events[0][2] == [3, 4, 5, 6, 7, 8]
    assert led.holes == sorted(led.holes) and len(led.holes) == led.evicted // 128


def test_short_prompt_compacts_only_when_over_budget():
    led = EvictionLedger(_policy("rkv", budget=256, interval=64), prefill_len=100)
    events = _walk(led, 400, block_size=16)
    assert [s for s, _, _ in events] == [192, 256, 320, 384]  # 100 + 192 = 292 > 256 at the first multiple of 64


def test_streamingllm_rolls_every_interval_entries():
    led = EvictionLedger(_policy("streamingllm", budget=64, sinks=4, interval=8), prefill_len=50)
    events = _walk(led, 100, block_size=16)
    # holds 64 + 8 - 1 entries at most: compacts when it would hold more (native threshold)
    assert [s for s, _, _ in events][:3] == [22, 30, 38]
    assert all(kept == 64 for _, kept, _ in events)


@pytest.mark.parametrize("block_size", [1, 7, 16, 128])
def test_live_blocks_always_cover_the_physical_length(block_size):
    for length in range(0, 600, 13):
        for evicted in range(0, length + 1, 11):
            assert live_blocks_cover(length, evicted, block_size)


def test_request_policies_the_vllm_engine_accepts():
    assert request_policy_of(None).evict is None
    pol = request_policy_of({"cotserve": {"policy": "skipkv", "options": {"budget": 128}}})
    assert pol.evict.name == "skipkv" and pol.evict.budget == 128 and pol.sfi is None
    h2o = request_policy_of({"cotserve": {"policy": "h2o", "options": {"budget": 64, "interval": 4}}})
    assert h2o.evict.name == "h2o" and h2o.evict.budget == 64 and h2o.evict.keep_last == 32
    with pytest.raises(PolicyError, match="snapkv"):
        request_policy_of({"cotserve": {"policy": "snapkv"}})
    with pytest.raises(PolicyError, match="window=32"):
        request_policy_of({"cotserve": {"policy": "rkv", "options": {"window": 32}}})
    both = request_policy_of({"cotserve": {"policy": "skipkv+steering", "options": {"alpha0": 2.0}}})
    assert both.evict.name == "skipkv" and both.steer.config.alpha0 == 2.0
    with pytest.raises(PolicyError, match="the engine's"):  # the vector is the engine's, not the request's
        request_policy_of({"cotserve": {"policy": "steering", "options": {"layer": 3}}})
    for platform in ("cpu", "cuda"):  # eviction with SFI runs on both backends
        pol = request_policy_of({"cotserve": {"policy": "skipkv+sfi", "options": {"sfi.dense_heads": 0}}},
                                platform=platform)
        assert pol.evict.name == "skipkv" and pol.sfi is not None


def test_the_flat_request_form_of_a_plain_vllm_serve():
    """vLLM's `vllm_xargs` carry only strings, numbers and lists: `cotserve_policy` plus
    `cotserve.<option>` keys give the same policy as the nested form."""
    flat = request_policy_of({"cotserve_policy": "skipkv+sfi", "cotserve.sfi.k": 96, "cotserve.budget": 256})
    nested = request_policy_of({"cotserve": {"policy": "skipkv+sfi", "options": {"sfi.k": 96, "budget": 256}}})
    assert flat.sfi.k == nested.sfi.k == 96 and flat.evict.budget == nested.evict.budget == 256
    assert request_policy_of({"cotserve_policy": "sfi"}).sfi is not None
    with pytest.raises(PolicyError, match="no policy in 'dense'"):  # options without a policy
        request_policy_of({"cotserve.k": 64})
    with pytest.raises(PolicyError, match="one form"):
        request_policy_of({"cotserve_policy": "sfi", "cotserve": {"policy": "sfi"}})
    with pytest.raises(PolicyError, match="not available on the vllm engine"):
        request_policy_of({"cotserve_policy": "snapkv"})
    with pytest.raises(PolicyError):
        request_policy_of({"cotserve_policy": "sfi", "cotserve.no_such_option": 1})
