"""The contract every registered policy keeps, checked for each one on the bundled model:

* batch-padding invariance: a sequence's greedy tokens are the same alone and beside a longer one;
* telemetry: the common keys, finite, and the allocated cache is never below its peak;
* seeded sampling is reproducible;
* every option given a value of the wrong type is refused with a PolicyError.

A policy added to the registry is covered without editing this file."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cotserve.engine.native import GenRequest
from cotserve.engine.sampling import SamplingParams
from cotserve.errors import PolicyError
from cotserve.policies.registry import REGISTRY, available, build_policy

POLICIES = available()
COMMON = ("policy", "prefill_s", "decode_s", "decode_tok_s", "kv_bytes_allocated", "kv_bytes_peak",
          "kv_bytes_final", "padding_fraction", "batch_size")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    long = tok("Sentence one is here. The quick brown fox jumps over the lazy dog, twice. " * 3)["input_ids"]
    short = tok("Count with me: one, two, three, four, five.")["input_ids"]
    return long, short


def test_the_registry_lists_every_policy():
    assert {"dense", "sfi", "skipkv", "rkv", "h2o", "snapkv", "streamingllm", "quest", "sinkrouter",
            "steering"} <= set(POLICIES)


@pytest.mark.parametrize("name", POLICIES)
def test_padding_invariance_telemetry_and_seeds(engine, prompts, name):
    long, short = prompts
    greedy, seeded = SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    batch = [GenRequest(long, greedy), GenRequest(short, greedy), GenRequest(short, seeded)]
    first = engine.generate(batch, name)
    alone = engine.generate([GenRequest(short, greedy)], name)
    again = engine.generate([GenRequest(r.prompt_ids, r.sampling) for r in batch], name)
    assert first[1].token_ids == alone[0].token_ids, f"{name}: padding changed the short sequence's tokens"
    assert first[2].token_ids == again[2].token_ids, f"{name}: a seeded request sampled differently"
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len(first[0].token_ids) == 6
    for c in (*first, *alone):
        tele = c.telemetry
        missing = [k for k in COMMON if k not in tele]
        assert not missing, f"{name}: telemetry lacks {missing}"
        assert name in str(tele["policy"])
        numbers = {k: v for k, v in tele.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert all(math.isfinite(v) for v in numbers.values()), f"{name}: non-finite telemetry {numbers}"
        assert tele["kv_bytes_allocated"] >= tele["kv_bytes_peak"] > 0


@pytest.mark.parametrize("name", POLICIES)
def test_every_option_refuses_a_wrong_type(name):
    cls = REGISTRY[name]
    fields = [f.name for f in dataclasses.fields(cls.config_cls)]
    for field in fields:
        with pytest.raises(PolicyError):
            build_policy(name, {field: [1, 2]})
