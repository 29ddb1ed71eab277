"""Sampling defaults from the model (`--generation-config auto|vllm|PATH`, as vLLM has it).

Reasoning models keep their recommended sampling in `generation_config.json` (e.g. DeepSeek-R1:
temperature 0.6, top_p 0.95). A request's own values always win; for the fields it leaves out:

  auto   (default) the model folder's generation_config.json: temperature, top_p, top_k and
         max_new_tokens (the default max_tokens); fields it lacks keep the server's defaults.
  vllm   ignore the model's file: the server's defaults (temperature 1.0, top_p 1, no top-k).
  PATH   a folder holding a generation_config.json (or the file itself).

Without any of these, `max_tokens` defaults to what remains of the context after the prompt
(`--max-model-len` caps the context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError

FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")


@dataclass
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None  # None: the rest of the context
    source: str = "server"  # where they came from (reported by /version)

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_tokens, "source": self.source}


def read_generation_config_file(path: Path) -> dict[str, Any]:
    """The JSON object of `path/generation_config.json` (or of `path` itself); {} without it."""
    file = path / "generation_config.json" if path.is_dir() else path
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise CotserveError(f"cannot parse {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise CotserveError(f"{file} must hold a JSON object")
    return data


def load_defaults(mode: str, model_dir: str | Path | None, base: SamplingDefaults | None = None) -> SamplingDefaults:
    """Defaults for `--generation-config MODE`, over `base` (the server's own defaults)."""
    base = base or SamplingDefaults()
    mode = (mode or "auto").strip()
    if mode == "vllm":
        return SamplingDefaults(base.temperature, base.top_p, base.top_k, base.max_tokens, "server")
    if mode == "auto":
        if model_dir is None:
            return base
        path, source = Path(model_dir), "model"
    else:
        path, source = Path(mode).expanduser(), str(mode)
        if not path.exists():
            raise CotserveError(f"--generation-config {mode}: no such file or folder (use auto, vllm or a path)")
    data = read_generation_config_file(path)
    if mode not in ("auto",) and not data:
        raise CotserveError(f"--generation-config {mode}: no generation_config.json there")
    out = SamplingDefaults(base.temperature, base.top_p, base.top_k, base.max_tokens, base.source)
    used = False
    try:
        if data.get("temperature") is not None:
            out.temperature, used = float(data["temperature"]), True
        if data.get("top_p") is not None:
            out.top_p, used = float(data["top_p"]), True
        if data.get("top_k") is not None:
            out.top_k, used = max(0, int(data["top_k"])), True
        if data.get("max_new_tokens") is not None:
            out.max_tokens, used = int(data["max_new_tokens"]), True
    except (TypeError, ValueError) as exc:
        raise CotserveError(f"generation config in {path}: {exc}") from exc
    if used:
        out.source = source
    return out
