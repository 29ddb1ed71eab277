"""Model resolution: bundled name, folders, GGUF conversion cache, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.errors import ModelError
from cotserve.models import (
    WeightOnlyLinear,
    cpu_has_native_bf16,
    pick_device,
    pick_dtype,
    pick_weight_dtype,
    resolve_model,
)


def test_bundled_model_resolves_to_cached_folder(loaded):
    path = resolve_model("smollm2-135m-instruct")
    assert (path / "config.json").is_file()
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    assert path == loaded.path  # second resolution hits the cache
    assert loaded.tokenizer.chat_template


def test_folder_is_accepted(loaded):
    assert resolve_model(str(loaded.path)) == loaded.path


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model(str(tmp_path / "nope"))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ModelError, match="not a GGUF file"):
        resolve_model(str(bad))


def test_truncated_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("COTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(ModelError, match="cannot read GGUF file"):
        resolve_model(str(bad))
    assert not list((tmp_path / "cache").glob("models/*/.complete"))


def test_other_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf"):
        resolve_model(str(f))


def test_device_and_dtype_auto():
    dev = pick_device("auto")
    assert dev.type in ("cpu", "cuda")
    import torch

    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ModelError, match="bf16w"):
        pick_dtype("int3", dev)
    # weight-only bf16: float32 compute, bf16 linear weights; auto picks it on a CPU with native
    # bf16 dot products only, never on CUDA (whose auto is bf16 throughout)
    assert pick_dtype("bf16w", torch.device("cpu")) == torch.float32
    assert pick_weight_dtype("bf16w", torch.device("cpu")) == torch.bfloat16
    assert pick_weight_dtype("float32", torch.device("cpu")) is None
    native = cpu_has_native_bf16()
    assert pick_weight_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else None)
    assert pick_weight_dtype("auto", torch.device("cuda")) is None


@pytest.mark.parametrize(("text", "native"), [("flags : fpu avx512f avx512_bf16 sse\n", True),
                                               ("flags : fpu amx_bf16 amx_tile\n", True),
                                               ("flags : fpu avx2 avx512f avx512_vnni\n", False), (None, False)])
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, text, native):
    """cpu_has_native_bf16 on cpuinfo texts (a fake: other CPUs cannot be had here); None = no
    /proc/cpuinfo (not Linux)."""
    import pathlib

    def read_text(self, *a, **kw):
        if text is None:
            raise FileNotFoundError(str(self))
        return text

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    assert cpu_has_native_bf16() is native


def test_weight_only_linear_matches_a_bf16_matmul_and_stays_close_to_float32():
    import torch

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
        lin.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(5, 64, generator=g)
    w = WeightOnlyLinear(lin, torch.bfloat16)
    y = w(x)
    assert y.dtype == torch.float32 and w.weight.dtype == torch.bfloat16
    ref = (x.bfloat16().float() @ lin.weight.detach().bfloat16().float().T).bfloat16().float() + lin.bias.detach()
    assert torch.allclose(y, ref, atol=1e-6)
    exact = lin(x).detach()
    assert not torch.equal(y, exact) and torch.allclose(y, exact, rtol=0.02, atol=0.02)


def test_bf16w_model_keeps_float32_activations_and_dense_s_predictions(loaded, engine):
    """The bundled model with bf16 weights: every linear layer narrowed (the tied LM head gets
    its own copy, the embedding stays float32), the engine computes in float32, and teacher-forced
    next-token predictions agree with the float32 model's."""
    import torch

    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.engine.sampling import SamplingParams
    from cotserve.models import load_model

    narrow = load_model("smollm2-135m-instruct", device="cpu", dtype="bf16w")
    assert narrow.dtype == torch.float32 and narrow.weight_dtype == torch.bfloat16
    linears = [m for m in narrow.model.modules() if isinstance(m, (torch.nn.Linear, WeightOnlyLinear))]
    assert linears and all(isinstance(m, WeightOnlyLinear) for m in linears)
    assert narrow.model.model.embed_tokens.weight.dtype == torch.float32
    assert narrow.model.lm_head.weight.dtype == torch.bfloat16
    prompt = engine.encode_prompt("Explain why the sum of two even numbers is even.")
    ref = engine.generate([GenRequest(prompt, SamplingParams(max_tokens=24, ignore_eos=True), record_logprobs=True)])[0]
    got = NativeEngine(narrow).generate([GenRequest(prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                                    record_logprobs=True, forced_ids=ref.token_ids)])[0]
    agree = sum(a == b for a, b in zip(ref.greedy_ids, got.greedy_ids, strict=True)) / len(ref.greedy_ids)
    p, q = ref.logprobs.float(), got.logprobs.float()
    kl = (p.exp() * (p - q)).sum(-1).mean()
    assert agree >= 0.9 and float(kl) < 0.02
    assert not torch.equal(p, q)  # the weights really changed


def test_cli_error_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "hi", "--model", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: unknown model '{tmp_path / 'x.gguf'}': not a bundled name (smollm2-135m-instruct), an existing folder, a .gguf file, or a Hugging Face id in the local cache"]
