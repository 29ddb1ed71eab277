"""Policy spec parsing: unknown names, options, conflicting stacks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cotserve.errors import PolicyError
from cotserve.policies.base import Axis, Policy, PolicyConfig
from cotserve.policies.registry import REGISTRY, build_policy, parse_options


@dataclass
class _ReadCfg(PolicyConfig):
    k: int = 8
    flag: bool = False


class _ReadA(Policy):
    name = "test_read_a"
    axis = Axis.READ
    config_cls = _ReadCfg


class _ReadB(Policy):
    name = "test_read_b"
    axis = Axis.READ
    config_cls = _ReadCfg


@pytest.fixture(autouse=True)
def _registered():
    REGISTRY[_ReadA.name] = _ReadA
    REGISTRY[_ReadB.name] = _ReadB
    yield
    REGISTRY.pop(_ReadA.name)
    REGISTRY.pop(_ReadB.name)


def test_dense_is_default():
    assert build_policy(None).name == "dense"
    (part,) = build_policy("dense").parts  # the dense read part: which attention decodes (kernel option)
    assert part.name == "dense" and part.config.kernel == "auto"


def test_unknown_policy():
    with pytest.raises(PolicyError, match="unknown policy 'nope'"):
        build_policy("nope")


def test_options_are_typed_and_checked():
    stack = build_policy("test_read_a", {"k": "16", "flag": "true"})
    assert stack.parts[0].config.k == 16 and stack.parts[0].config.flag is True
    with pytest.raises(PolicyError, match="no policy .* has an option 'zzz'"):
        build_policy("test_read_a", {"zzz": 1})
    with pytest.raises(PolicyError, match="k='x'"):
        build_policy("test_read_a", {"k": "x"})


def test_conflicting_stack_is_refused():
    with pytest.raises(PolicyError, match="conflict"):
        build_policy("test_read_a+test_read_b")


def test_parse_options_file_and_pairs(tmp_path):
    f = tmp_path / "opts.yaml"
    f.write_text("k: 4\nsfi:\n  recent: 128\n")
    opts = parse_options(["k=32"], str(f))
    assert opts == {"k": "32", "sfi.recent": 128}
    with pytest.raises(PolicyError):
        parse_options(["novalue"])


def test_stack_runs_eviction_before_reading():
    stack = build_policy("sfi+skipkv")
    assert [p.axis for p in stack.parts] == ["evict", "read"]
    assert stack.name == "skipkv+sfi"


def test_an_unknown_option_lists_the_valid_ones():
    with pytest.raises(PolicyError, match=r"has an option 'kk' \(did you mean k\? options: .*\bk\b.*recent"):
        build_policy("sfi", {"kk": 1})
    with pytest.raises(PolicyError, match=r"did you mean budget"):
        build_policy("skipkv+sfi", {"budgett": 1})
