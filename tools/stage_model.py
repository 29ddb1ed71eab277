"""Carry a model folder to a machine that reaches no model hub, in parts small enough for one
transfer each (a lent GPU machine takes at most 64 MiB per call).

    python tools/stage_model.py pack [MODEL] [OUT]     here: MODEL's folder (default: the bundled model,
                                                       converted from its GGUF) as bf16 safetensors,
                                                       tarred and cut into OUT/part.NNN (default
                                                       .vllm-dev/model, 56 MiB each)
    python tools/stage_model.py unpack DIR... TARGET   there: join the parts found in the DIRs (in name
                                                       order) and unpack the folder into TARGET

bf16 halves float32 weights (the bundled model: 538 MB -> 269 MB, five parts); vLLM serves it in
bf16 on a GPU anyway. The parts carry a SHA-256 of the whole in `sha256.txt`, checked on unpack.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

PART = 56 << 20  # with the working tree (a few MiB), one part fits a 64 MiB transfer


def pack(model: str = "smollm2-135m-instruct", out: str = ".vllm-dev/model") -> list[Path]:
    import torch
    from safetensors.torch import load_file, save_file

    from cotserve.models import resolve_model

    src = Path(resolve_model(model))
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("part.*"):
        old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(p for p in src.iterdir() if p.is_file()):
            if f.suffix == ".safetensors":
                state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(f).items()}
                data = _safetensors_bytes(state, save_file)
            elif f.name == "config.json":
                cfg = json.loads(f.read_text())
                for key in ("dtype", "torch_dtype"):
                    if key in cfg:
                        cfg[key] = "bfloat16"
                data = (json.dumps(cfg, indent=2) + "\n").encode()
            else:
                data = f.read_bytes()
            info = tarfile.TarInfo(f"model/{f.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    parts = []
    for i in range(0, len(blob), PART):
        p = dest / f"part.{i // PART:03d}"
        p.write_bytes(blob[i : i + PART])
        parts.append(p)
    (dest / "sha256.txt").write_text(hashlib.sha256(blob).hexdigest() + "\n")
    return parts


def _safetensors_bytes(state: dict, save_file) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
        return path.read_bytes()


def unpack(dirs: list[str], target: str) -> Path:
    parts = sorted((p for d in dirs for p in Path(d).glob("part.*")), key=lambda p: p.name)
    if not parts:
        raise SystemExit(f"no part.NNN files in {dirs}")
    blob = b"".join(p.read_bytes() for p in parts)
    sums = [Path(d) / "sha256.txt" for d in dirs if (Path(d) / "sha256.txt").is_file()]
    if not sums:
        raise SystemExit(f"no sha256.txt in {dirs}: carry it with the parts")
    if hashlib.sha256(blob).hexdigest() != sums[0].read_text().strip():
        raise SystemExit(f"the parts do not add up ({len(parts)} found): a part is missing or damaged")
    dest = Path(target)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "model"


def main(argv: list[str]) -> None:
    if argv[:1] == ["pack"]:
        for p in pack(*argv[1:3]):
            print(p, p.stat().st_size)
    elif argv[:1] == ["unpack"] and len(argv) >= 3:
        print(unpack(argv[1:-1], argv[-1]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
