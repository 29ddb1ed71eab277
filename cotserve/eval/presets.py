"""Sampling presets (`--preset`): where temperature, top-p and max tokens come from.

Each setting is taken from the first of:

1. the flag given on the command line (`--temperature`, `--top-p`, `--max-tokens`);
2. the preset:
   - `none` (default): nothing, so 3. applies;
   - `model`: the model's `generation_config.json` (`temperature`, `top_p`, `max_new_tokens`);
   - `r1`: the model's `generation_config.json` where it sets a field, else DeepSeek-R1's
     recommended sampling for reasoning models: temperature 0.6, top-p 0.95, 32768 max tokens;
3. the defaults: temperature 0 (greedy), top-p 1.0, 2048 max tokens.

The model's folder is the local model (`--model`, resolved as the native engine resolves it: a
bundled name, a folder, a `.gguf`, a Hugging Face id in the local cache); through an endpoint it
is `--model` when that names such a folder or cached id, else there is none and the preset's own
values apply. The source of every setting is recorded in `run_config.json`, `results.json` and
`report.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cotserve.errors import CotserveError

DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 2048}
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "max_tokens": "--max-tokens"}
GEN_FIELDS = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_new_tokens"}


@dataclass(frozen=True)
class Preset:
    name: str
    values: dict[str, float | int]  # used where the model's generation_config.json is silent
    use_model_config: bool
    about: str


PRESETS = {
    "none": Preset("none", {}, False, "the flags and the defaults only"),
    "model": Preset("model", {}, True, "the model's generation_config.json"),
    "r1": Preset("r1", {"temperature": 0.6, "top_p": 0.95, "max_tokens": 32768}, True,
                 "DeepSeek-R1's reasoning sampling (temperature 0.6, top-p 0.95, 32768 tokens), "
                 "the model's generation_config.json first"),
}


def read_generation_config(folder: Path | None) -> dict[str, float | int]:
    """temperature, top_p and max_new_tokens (as max_tokens) from `folder/generation_config.json`;
    {} without the file. A malformed file is an error, not a silent default."""
    if folder is None:
        return {}
    from cotserve.gateway.defaults import read_generation_config_file

    path = Path(folder) / "generation_config.json"
    data = read_generation_config_file(path)
    out: dict[str, float | int] = {}
    try:
        for key, field in GEN_FIELDS.items():
            if data.get(field) is not None:
                out[key] = int(data[field]) if key == "max_tokens" else float(data[field])
    except (TypeError, ValueError) as exc:
        raise CotserveError(f"{path}: {exc}") from None
    return out


def model_folder(model: str | None, local: bool) -> Path | None:
    """The folder holding the model's files, when there is one here (see the module doc)."""
    from cotserve.errors import ModelError
    from cotserve.models.load import resolve_model

    if not local and not model:
        return None
    try:
        return resolve_model(model)
    except (ModelError, OSError):
        if local:
            raise
        return None


def resolve_sampling(preset: str, folder: Path | None, temperature: float | None, top_p: float | None,
                     max_tokens: int | None) -> tuple[dict[str, Any], dict[str, str]]:
    """(settings, where each came from) for the preset, the model folder and the flags."""
    if preset not in PRESETS:
        raise CotserveError(f"--preset {preset!r}: expected {', '.join(PRESETS)}")
    p = PRESETS[preset]
    given = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
    gen = read_generation_config(folder) if p.use_model_config else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in DEFAULTS:
        if given[key] is not None:
            values[key], sources[key] = given[key], FLAGS[key]
        elif key in gen:
            values[key], sources[key] = gen[key], f"generation_config.json ({folder})"
        elif key in p.values:
            values[key], sources[key] = p.values[key], f"preset {p.name}"
        else:
            values[key], sources[key] = DEFAULTS[key], "default"
    values["max_tokens"] = int(values["max_tokens"])
    return values, sources
