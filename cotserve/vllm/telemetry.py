"""The plugin's way out of vLLM's engine process: one JSON line per finished request."""

from __future__ import annotations

import json
import os

import torch

from cotserve.vllm.settings import settings, variable

_TELEMETRY = variable("telemetry")  # read at every step's plan: one lookup, not all the settings

# the CUDA caching allocator's counters the runtimes report: a retry frees cached blocks (which
# synchronizes the device) to fit an allocation; device allocations and frees are cudaMalloc/cudaFree
ALLOCATOR_COUNTERS = {"cuda_alloc_retries": "num_alloc_retries", "cuda_device_allocs": "num_device_alloc",
                      "cuda_device_frees": "num_device_free"}


def telemetry_on() -> bool:
    """Whether finished requests' telemetry goes anywhere (what to compute only then)."""
    return bool(os.environ.get(_TELEMETRY))


def write_telemetry(tele: dict) -> None:
    """Append a JSON line to $COTSERVE_VLLM_TELEMETRY when it is set (the benchmarks and tests read it)."""
    path = settings().telemetry
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(tele) + "\n")


def allocator_counters(device: torch.device) -> dict[str, int]:
    """The CUDA allocator's counters for `device` since the process started ({} off CUDA): whether a
    runtime's host time went into allocations that waited for the GPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()}
