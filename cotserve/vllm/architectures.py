"""cotserve's architecture names in vLLM's model registry, and which engine asks for cotserve.

The plugin registers its model classes (`models.py`: vLLM's own plus the final hidden states and
the steering hook) under names of its own, `Cotserve` + vLLM's class name, never over vLLM's: a
plain vLLM engine in the same environment keeps vLLM's classes. An engine selects cotserve's with
`hf_overrides={"architectures": [...]}` (`hf_overrides`; `cotserve serve --engine vllm` passes
it, a plain `vllm serve` takes `--hf-overrides '{"architectures": ["CotserveLlamaForCausalLM"]}'`).

An engine asks for cotserve when it runs one of these classes or was started by `cotserve serve
--engine vllm` (`gpu_memory.COTSERVE_CONFIG` in vLLM's `additional_config`); on any other
engine the plugin's row tracker gives no request a policy, so the CPU backend (registered over
vLLM's `CPU_ATTN`) runs exactly vLLM's CPU attention.
"""

from __future__ import annotations

import json
from pathlib import Path

from cotserve.vllm import compat
from cotserve.vllm.gpu_memory import started_by_cotserve

PREFIX = "Cotserve"
# architecture names (as in a model's config.json) -> the vLLM class cotserve's class extends
ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "LlamaModel": "LlamaForCausalLM",
    "Qwen2ForCausalLM": "Qwen2ForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
}
# a config.json without architectures (a converted GGUF's): its model_type -> the vLLM class
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def own_name(base: str) -> str:
    """cotserve's architecture name for its class over vLLM's `base`."""
    return PREFIX + base


def own_architectures(names: list[str]) -> list[str]:
    """cotserve's architecture names for a model's architectures ([] when it has none of them)."""
    return [own_name(ARCHITECTURES[n]) for n in names if n in ARCHITECTURES]


def model_architectures(model_path: str | Path) -> list[str]:
    """The architectures in a model folder's config.json, or the class for its model_type where
    it names none ([] without a config.json)."""
    cfg = Path(model_path) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return []
    given = list(data.get("architectures") or [])
    if not given and data.get("model_type") in MODEL_TYPES:
        given = [MODEL_TYPES[data["model_type"]]]
    return given


def hf_overrides(model_path: str | Path) -> dict:
    """vLLM's `hf_overrides` that select cotserve's model classes for a model folder ({} for a
    model without one of them: vLLM's own class runs, without SkipKV's hidden states or steering)."""
    own = own_architectures(model_architectures(model_path))
    return {"architectures": own} if own else {}


def asks_for_cotserve(vllm_config) -> bool:
    """Whether the engine runs cotserve's model classes or was started by cotserve."""
    if vllm_config is None:
        return False
    runs = any(a.startswith(PREFIX) for a in compat.architectures(getattr(vllm_config, "model_config", None)))
    return runs or started_by_cotserve(vllm_config)
