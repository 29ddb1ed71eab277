"""tools/stage_model.py: the bundled model in parts that each fit one transfer, joined and unpacked
elsewhere into the same weights (bf16) and files; a missing part is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch


def test_parts_fit_a_transfer_and_unpack_to_the_same_model(tmp_path, load_tool):
    from safetensors.torch import load_file

    from cotserve.models import resolve_model

    tool = load_tool("stage_model")
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


def test_gguf_bundle_converts_there_to_the_packed_weights(tmp_path, load_tool):
    """`pack-gguf` carries the GGUF (a third of the bf16 folder's bytes) with the wheels that read it and
    per-tensor digests; unpacking converts it to the same bf16 weights, and refuses where a
    tensor differs from the digests taken here."""
    import json
    import tarfile

    from safetensors.torch import load_file

    from cotserve.models import resolve_model

    tool = load_tool("stage_model")
    parts = tool.pack_gguf(str(tmp_path / "parts"), sizes=[3, 40])
    assert [p.stat().st_size for p in parts[:-1]] == [3 << 20] + [40 << 20] * (len(parts) - 2)
    assert 0 < parts[-1].stat().st_size <= 40 << 20
    folder = tool.unpack([str(tmp_path / "parts")], str(tmp_path / "out"))
    assert any((tmp_path / "out" / "site").glob("gguf/__init__.py"))
    src = Path(resolve_model("smollm2-135m-instruct"))
    got, want = load_file(folder / "model.safetensors"), load_file(src / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    # the same bundle with one digest changed: the conversion there is refused
    blob = b"".join(p.read_bytes() for p in parts)
    bad = tmp_path / "bad.tar"
    bad.write_bytes(blob)
    with tarfile.open(bad) as tar:
        digests = json.loads(tar.extractfile("weights.json").read())
    digests["model.norm.weight"] = "0" * 64
    (tmp_path / "out" / "weights.json").write_text(json.dumps(digests))
    with pytest.raises(SystemExit, match="1 tensors differ"):
        tool._convert(tmp_path / "out")
