"""The plugin's settings: every `COTSERVE_VLLM_*` variable is read in `cotserve/vllm/settings.py`
alone, each is documented, and a bad value is refused with the variable's name."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from cotserve.vllm.settings import PREFIX, PluginSettings, variable

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(PREFIX + r"[A-Z0-9_]+")


def test_unset_variables_leave_the_defaults():
    assert PluginSettings.from_env({}) == PluginSettings()
    assert PluginSettings.from_env({variable("sfi_slots"): ""}).sfi_slots is None


def test_values_are_parsed_by_their_field():
    s = PluginSettings.from_env({variable("sfi_slots"): "8", variable("evict_slots"): "0",
                                 variable("telemetry"): "/tmp/t.jsonl", variable("h2o_max_len"): "512"})
    assert (s.sfi_slots, s.evict_slots, s.telemetry, s.h2o_max_len) == (8, 0, "/tmp/t.jsonl", 512)


def test_a_bad_value_names_its_variable():
    with pytest.raises(ValueError, match="COTSERVE_VLLM_SFI_MAX_K must be an integer"):
        PluginSettings.from_env({variable("sfi_max_k"): "lots"})


def test_only_the_settings_module_names_the_variables():
    """No other module holds a variable's name as a string of its own (it reads `settings()`, or
    writes through `variable(...)`); docstrings and messages may mention them."""
    offenders = []
    for path in (ROOT / "cotserve").rglob("*.py"):
        if path.name == "settings.py" and path.parent.name == "vllm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert offenders == []


def test_every_variable_is_documented_and_every_documented_one_exists():
    known = {variable(f.name) for f in fields(PluginSettings)}
    text = (ROOT / "docs" / "vllm.md").read_text()
    documented = set(re.findall(r"\| `(" + PREFIX + r"[A-Z0-9_]+)` \|", text))
    assert documented == known
    mentioned = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "cotserve").rglob("*.py")]:
        if "results" not in path.parts:
            mentioned |= set(NAME.findall(path.read_text()))
    assert mentioned - known == set()
