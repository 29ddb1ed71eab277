"""Models: resolution, loading, devices and dtypes, one module per job.

* `gguf`: where converted models live (`cache_root`), the bundled GGUF files, GGUF conversion;
* `random_model`: a random-weight model of a named shape with a synthetic tokenizer;
* `devices`: device and dtype picking (compute dtype, weight dtype);
* `weights`: the weight-only linear layer and weight narrowing;
* `loaded`: `LoadedModel`; `load`: `resolve_model` and `load_model`.

The public names are exported here: `from cotserve.models import load_model`.
"""

from __future__ import annotations

from cotserve.model_names import BUNDLED_MODELS, DEFAULT_MODEL, model_slug
from cotserve.models.devices import (
    DTYPES,
    WEIGHT_ONLY,
    cpu_has_native_bf16,
    pick_device,
    pick_dtype,
    pick_weight_dtype,
)
from cotserve.models.gguf import CONVERTED_FORMAT, bundled_gguf_path, cache_root, convert_gguf
from cotserve.models.load import load_model, resolve_model
from cotserve.models.loaded import LoadedModel
from cotserve.models.random_model import RANDOM_SHAPES, load_random_model
from cotserve.models.weights import WeightOnlyLinear, narrow_weights, store_linear_weights

__all__ = [
    "BUNDLED_MODELS", "CONVERTED_FORMAT", "DEFAULT_MODEL", "DTYPES", "RANDOM_SHAPES", "WEIGHT_ONLY",
    "LoadedModel", "WeightOnlyLinear", "bundled_gguf_path", "cache_root", "convert_gguf",
    "cpu_has_native_bf16", "load_model", "load_random_model", "model_slug", "narrow_weights",
    "pick_device", "pick_dtype", "pick_weight_dtype", "resolve_model", "store_linear_weights",
]
