"""tools/stage_model.py: the bundled model in parts that each fit one transfer, joined and unpacked
elsewhere into the same weights (bf16) and files; a missing part is refused."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("stage_model", ROOT / "tools" / "stage_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parts_fit_a_transfer_and_unpack_to_the_same_model(tmp_path):
    from safetensors.torch import load_file

    from cotserve.models import resolve_model

    tool = _tool()
    parts = tool.pack("smollm2-135m-instruct", str(tmp_path / "parts"))
    assert len(parts) > 1 and all(p.stat().st_size <= tool.PART for p in parts)
    a, b = tmp_path / "a", tmp_path / "b"  # parts carried in different transfers
    a.mkdir(), b.mkdir()
    for i, p in enumerate(parts):
        shutil.copy(p, (a if i % 2 else b) / p.name)
    shutil.copy(tmp_path / "parts" / "sha256.txt", a)
    folder = tool.unpack([str(a), str(b)], str(tmp_path / "out"))
    src = Path(resolve_model("smollm2-135m-instruct"))
    got, want = load_file(folder / "model.safetensors"), load_file(src / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    assert (folder / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert '"bfloat16"' in (folder / "config.json").read_text()
    with pytest.raises(SystemExit, match="sha256"):
        tool.unpack([str(b)], str(tmp_path / "unchecked"))  # parts without their checksum
    (b / parts[0].name).unlink()
    with pytest.raises(SystemExit, match="do not add up"):
        tool.unpack([str(a), str(b)], str(tmp_path / "again"))
