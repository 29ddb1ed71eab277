"""Carry a model folder to a machine that reaches no model hub, in parts small enough for one
transfer each (a lent GPU machine takes at most 64 MiB per call).

    python tools/stage_model.py pack [MODEL] [OUT]     here: MODEL's folder (default: the bundled model,
                                                       converted from its GGUF) as bf16 safetensors,
                                                       tarred and cut into OUT/part.NNN (default
                                                       .vllm-dev/model, 56 MiB each)
    python tools/stage_model.py pack-gguf [OUT] [MiB,MiB,...]
                                                       here: the bundled model's GGUF itself (94 MiB
                                                       instead of 269), the wheels that read it
                                                       and the digests of the bf16 weights it converts
                                                       to, cut into parts of the given sizes (the last
                                                       size repeats; default 56)
    python tools/stage_model.py unpack DIR... TARGET   there: join the parts found in the DIRs (in name
                                                       order) and unpack the folder into TARGET; parts of
                                                       `pack-gguf` are converted there (transformers'
                                                       GGUF loader, as here), cast to bf16 and checked
                                                       against the digests

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
READER = ("gguf", "accelerate")  # what transformers' GGUF loader needs beyond transformers itself


def pack(model: str = "smollm2-135m-instruct", out: str = ".vllm-dev/model") -> list[Path]:
    from cotserve.models import resolve_model

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in bf16_files(Path(resolve_model(model))):
            _add(tar, f"model/{name}", data)
    return _cut(buf.getvalue(), Path(out), [PART])


def pack_gguf(out: str = ".vllm-dev/model", sizes: list[int] | None = None) -> list[Path]:
    """The bundled GGUF, the wheels of READER (fetched from the package index into a temporary folder)
    and `weights.json`, the digests of the bf16 weights it converts to here."""
    import subprocess
    import tempfile
    from importlib.metadata import version

    from cotserve.models import bundled_gguf_path, resolve_model

    gguf = bundled_gguf_path("smollm2-135m-instruct")
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory() as d, tarfile.open(fileobj=buf, mode="w") as tar:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d,
                        *(f"{n}=={version(n)}" for n in READER)], check=True)
        for whl in sorted(Path(d).glob("*.whl")):
            _add(tar, f"wheels/{whl.name}", whl.read_bytes())
        digest = weights_digest(dict(bf16_files(Path(resolve_model("smollm2-135m-instruct")))))
        _add(tar, "weights.json", (json.dumps(digest, indent=1) + "\n").encode())
        _add(tar, f"gguf/{gguf.name}", gguf.read_bytes())
    return _cut(buf.getvalue(), Path(out), [s << 20 for s in (sizes or [PART >> 20])])


def bf16_files(src: Path) -> list[tuple[str, bytes]]:
    """A model folder's files with its safetensors weights in bf16 and its config saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    files = []
    for f in sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith(".")):
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
        files.append((f.name, data))
    return files


def weights_digest(files: dict[str, bytes]) -> dict[str, str]:
    """SHA-256 of every tensor's dtype, shape and bytes, by name (not of the file bytes: two
    safetensors writers may order or annotate the same tensors differently)."""
    import torch
    from safetensors.torch import load

    out = {}
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        state = load(files[name])
        for k in sorted(state):
            t = state[k].contiguous()
            h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            out[k] = h.hexdigest()
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _cut(blob: bytes, dest: Path, sizes: list[int]) -> list[Path]:
    """`blob` in parts of the given sizes (the last size repeating), with its SHA-256."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("part.*"):
        old.unlink()
    parts, at = [], 0
    while at < len(blob):
        size = sizes[min(len(parts), len(sizes) - 1)]
        p = dest / f"part.{len(parts):03d}"
        p.write_bytes(blob[at : at + size])
        parts.append(p)
        at += size
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
    if (dest / "weights.json").is_file():
        return _convert(dest)
    return dest / "model"


def _convert(dest: Path) -> Path:
    """A `pack-gguf` bundle: its wheels onto the path, the GGUF converted and cast to bf16 into
    dest/model, its weights checked against the digest taken where it was packed."""
    import zipfile

    site = dest / "site"
    for whl in sorted((dest / "wheels").glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    sys.path.insert(0, str(site))
    from cotserve.models import convert_gguf

    (gguf,) = (dest / "gguf").glob("*.gguf")
    files = dict(bf16_files(convert_gguf(gguf)))
    folder = dest / "model"
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    want, got = json.loads((dest / "weights.json").read_text()), weights_digest(files)
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    if differ:
        raise SystemExit(f"{folder}: {len(differ)} tensors differ from the packed model's, e.g. {differ[:3]} "
                         "(another transformers or gguf version de-quantizes differently)")
    return folder


def main(argv: list[str]) -> None:
    if argv[:1] == ["pack"]:
        for p in pack(*argv[1:3]):
            print(p, p.stat().st_size)
    elif argv[:1] == ["pack-gguf"] and len(argv) <= 3:
        sizes = [int(x) for x in argv[2].split(",")] if len(argv) == 3 else None
        for p in pack_gguf(*argv[1:2], sizes=sizes):
            print(p, p.stat().st_size)
    elif argv[:1] == ["unpack"] and len(argv) >= 3:
        print(unpack(argv[1:-1], argv[-1]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
