"""Model resolution: bundled name, folders, GGUF conversion cache, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotserve.errors import ModelError
from cotserve.models import pick_device, pick_dtype, resolve_model


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
    with pytest.raises(ModelError):
        pick_dtype("int3", dev)


def test_cli_error_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cotserve.cli", "generate", "hi", "--model", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: unknown model '{tmp_path / 'x.gguf'}': not a bundled name (smollm2-135m-instruct), an existing folder, or a .gguf file"]
