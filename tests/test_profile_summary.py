"""tools/device/profile_summary.py: the GPU's idle time in a step profile and the plugin's ranges that
the host was in meanwhile, on a trace of known spans."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "tools" / "device" / "profile_summary.py"
_spec = importlib.util.spec_from_file_location("profile_summary", _PATH)
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_gaps_are_charged_to_the_ranges_the_host_was_in(tmp_path, capsys):
    events = [_x("kernel", "attn", 0, 100), _x("kernel", "mlp", 50, 100), _x("kernel", "attn", 250, 50),
              _x("gpu_memcpy", "Memcpy HtoD", 400, 100),
              _x("user_annotation", "cotserve: sfi refreshes", 240, 180),
              _x("user_annotation", "gpu_model_runner: forward", 0, 50),  # not the plugin's: not charged
              _x("cuda_runtime", "cudaGraphLaunch", 0, 5), _x("cuda_runtime", "cudaGraphLaunch", 200, 5),
              _x("cuda_runtime", "cudaGraphLaunch", 500, 5), {"ph": "i", "name": "marker", "ts": 3}]
    s = ps.summarize(events)
    assert s["window_ms"] == 0.5 and s["device_busy_ms"] == 0.3 and s["device_busy"] == 0.6
    idle = s["device_idle"]
    assert idle["total_ms"] == 0.2 and idle["gaps"] == 2 and idle["longest_ms"] == 0.1
    assert idle["while_in_range_ms"] == {"cotserve: sfi refreshes": 0.11}  # [240, 250] and [300, 400]
    assert s["ranges"]["cotserve: sfi refreshes"]["count"] == 1 and "gpu_model_runner: forward" not in s["ranges"]
    assert s["steps"]["graph_launches"] == 3 and s["steps"]["period_median_ms"] == 0.25
    assert s["kernels"][0] == {"name": "attn", "count": 2, "total_ms": 0.15, "mean_us": 75.0}
    path = tmp_path / "steps-1.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    assert ps.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["device_idle"]["gaps"] == 2
    assert ps.main([]) == 2
