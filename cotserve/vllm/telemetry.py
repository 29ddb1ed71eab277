"""The plugin's way out of vLLM's engine process: one JSON line per finished request."""

from __future__ import annotations

import json
import os


def write_telemetry(tele: dict) -> None:
    """Append a JSON line to $COTSERVE_VLLM_TELEMETRY when it is set (the benchmarks and tests read it)."""
    path = os.environ.get("COTSERVE_VLLM_TELEMETRY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(tele) + "\n")
