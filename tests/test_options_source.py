"""Every policy option has one definition, its field in `cotserve/policies/options.py`: the
policies' dataclass configs take theirs from it, code that needs a default reads it there, and
the generated option tables are current (`make docs`)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cotserve.policies.interface import Runtime
from cotserve.policies.options import POLICIES, SFIOptions, StreamingLLMOptions, check_config, options_config

ROOT = Path(__file__).resolve().parent.parent
OPTION_NAMES = frozenset(name for _, model in POLICIES.values() for name in model.model_fields)


def _is_config_class(node: ast.ClassDef) -> bool:
    """A dataclass (or an options config) whose base is a policy config (`...Config`)."""
    def name(expr: ast.expr) -> str:
        target = expr.func if isinstance(expr, ast.Call) else expr
        return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")

    decorated = any(name(d) in ("dataclass", "options_config") for d in node.decorator_list)
    return decorated and any(name(b).endswith("Config") for b in node.bases)


def options_declared_twice(source: str) -> list[str]:
    """`Class.field` for each field of a policy config in `source` that names an option and gives
    it a default of its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and _is_config_class(node):
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in OPTION_NAMES and stmt.value is not None):
                    found.append(f"{node.name}.{stmt.target.id}")
    return found


def test_no_policy_config_declares_an_option_of_its_own():
    from cotserve.policies.registry import REGISTRY, available

    twice, seen = {}, set()
    for path in sorted((ROOT / "cotserve" / "policies").rglob("*.py")):
        source = path.read_text()
        seen |= {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and _is_config_class(n)}
        found = options_declared_twice(source)
        if found:
            twice[str(path.relative_to(ROOT))] = found
    assert not twice, f"define these options in cotserve/policies/options.py only: {twice}"
    assert {REGISTRY[name].config_cls.__name__ for name in available()} <= seen  # the walk sees every config


def test_the_check_finds_an_option_declared_twice():
    source = ("@dataclass\nclass DemoConfig(PolicyConfig):\n    budget: int = 1024\n    own: int = 3\n\n"
              "@options_config(SFIOptions)\nclass OtherConfig(EvictionConfig):\n    k: int = 2048\n\n"
              "@dataclass\nclass NotAConfig:\n    budget: int = 1\n")
    assert options_declared_twice(source) == ["DemoConfig.budget", "OtherConfig.k"]


def test_each_policy_config_is_built_from_its_options_model():
    from cotserve.policies.registry import REGISTRY, available

    for name in available():
        if name not in POLICIES:
            continue
        config_cls, model = REGISTRY[name].config_cls, POLICIES[name][1]
        assert config_cls.options_model is model, name
        fields = dataclasses.fields(config_cls)
        assert [f.name for f in fields] == list(model.model_fields), name
        for f in fields:
            info = model.model_fields[f.name]
            assert f.type == info.annotation, f"{name}.{f.name}"
            assert f.default == info.default or (f.default != f.default and info.default != info.default), \
                f"{name}.{f.name}"


def test_options_config_refuses_an_option_declared_in_the_class():
    with pytest.raises(TypeError, match="declares recent, sinks, options of StreamingLLMOptions"):
        @options_config(StreamingLLMOptions)
        class Twice:
            sinks: int = 4
            recent = 0

    @options_config(StreamingLLMOptions)
    class Kept:
        extra: int = 7  # a field that is no option is kept, after the options

        @property
        def kept(self) -> int:
            return self.sinks + self.recent

    k = Kept(budget=64, extra=1)
    assert [f.name for f in dataclasses.fields(Kept)] == [*StreamingLLMOptions.model_fields, "extra"]
    assert (k.budget, k.sinks, k.extra, k.kept) == (64, 4, 1, 4)


def test_a_config_built_without_the_registry_is_checked_by_its_model():
    from cotserve.policies.sfi.config import SFIConfig
    from cotserve.policies.streamingllm import StreamingLLMConfig

    SFIConfig().validate()
    with pytest.raises(ValueError, match="obs_window=0: Input should be greater than or equal to 1"):
        SFIConfig(obs_window=0).validate()
    with pytest.raises(ValueError, match=r"sinks \+ recent \(12\) exceeds budget \(8\)"):
        StreamingLLMConfig(budget=8, sinks=4, recent=8).validate()
    with pytest.raises(ValueError, match="kernel="):
        check_config(SFIConfig(kernel="no-such-kernel"))


def test_defaults_elsewhere_are_read_from_the_models():
    from cotserve.policies.sfi.config import SFIConfig
    from cotserve.policies.sfi.trigger import RefreshTrigger

    trig, cfg = RefreshTrigger(), SFIConfig()
    assert (trig.mode, trig.min_gap, trig.max_interval, trig.cooldown, trig.period) == (
        cfg.trigger, cfg.min_gap, cfg.max_interval, cfg.cooldown, cfg.period)
    assert SFIOptions.model_fields["max_interval"].default == trig.max_interval


def test_runtimes_are_declared_on_each_policy():
    from cotserve.policies.registry import REGISTRY, available, runs_on

    for name in available():
        assert Runtime.NATIVE <= REGISTRY[name].runtimes <= Runtime.ALL, name
    on_vllm = sorted(["dense", "sfi", "rkv", "skipkv", "streamingllm", "h2o", "steering"])
    assert runs_on(Runtime.VLLM_CPU) == runs_on(Runtime.VLLM_CUDA) == runs_on(*Runtime.VLLM) == on_vllm
    assert runs_on(Runtime.NATIVE_CONTINUOUS) == runs_on(Runtime.NATIVE_STATIC) == available()
    assert runs_on("no-such-runtime") == []


def test_the_generated_docs_are_current():
    out = subprocess.run([sys.executable, "tools/gen_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
