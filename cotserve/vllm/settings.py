"""The plugin's settings inside vLLM's processes: every `COTSERVE_VLLM_*` environment variable is
read here and nowhere else (a test checks it), into one `PluginSettings`.

vLLM starts its engine and workers as new processes; the environment is what reaches them from
`cotserve serve --engine vllm`, `vllm serve` or a benchmark, so these stay environment variables.
`settings()` reads them when asked (tests and benchmarks set them before an engine starts); a value
that is not what its variable takes raises one `ValueError` naming the variable. docs/vllm.md has
the table of what each one does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "COTSERVE_VLLM_"


@dataclass(frozen=True)
class PluginSettings:
    """One field per variable (`PREFIX` + the field's name in capitals); None where it is unset."""

    sfi_slots: int | None = None  # SFI requests a CUDA engine decodes at once (default: `gpu_memory.sfi_slots`)
    sfi_max_k: int | None = None  # the largest k a CUDA SFI request may ask (default: SFI's default k)
    scratch_mib: int | None = None  # working tensors reserved inside vLLM's budget (`gpu_memory.scratch_bytes`)
    evict_slots: int | None = None  # evicting requests at once on CUDA (default: max_num_seqs); 0 leaves eviction out
    h2o_max_len: int = 2048  # entries per layer and KV head h2o's score buffers hold; 0 leaves h2o out
    steering_vector: str | None = None  # the engine's steering vector file
    steering_layer: int | None = None  # the decoder layer it steers (default: the vector's own)
    telemetry: str | None = None  # a file: one JSON line per finished SFI, evicting or steered request
    sched_stats: str | None = None  # a file: one line per scheduler step
    evict_trace: str | None = None  # a file: the kept entries' true positions per compaction
    profile_dir: str | None = None  # a directory: a `trigger` file there profiles the next steps (`step_profile`)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            raw = env.get(variable(f.name), "")
            if raw == "":
                continue
            if "int" in str(f.type):
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ValueError(f"{variable(f.name)} must be an integer, not {raw!r}") from None
            else:
                values[f.name] = raw
        return cls(**values)


def variable(name: str) -> str:
    """The environment variable of a `PluginSettings` field."""
    return PREFIX + name.upper()


def settings() -> PluginSettings:
    """The settings as the environment has them now."""
    return PluginSettings.from_env()
