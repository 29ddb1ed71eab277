"""Where a step profile's time went: `python tools/device/profile_summary.py steps-*.json.gz` (the
trace `cotserve/vllm/step_profile.py` writes) prints one JSON object:

* `window_ms`, `device_busy_ms` (the union of the GPU's kernels and copies) and `device_busy`;
* `device_idle`: the GPU's idle gaps (total, count, the longest) and, for each of the plugin's named
  ranges (`cotserve: ...`), how much of that idle time fell while the host was inside it;
* `ranges`: each named range's count and host time (total, median, max);
* `steps`: the CUDA graph launches (one per graph-captured step) and the time between them (median, p90);
* `kernels`: the device's top kernels by total time.

Nothing here runs on the GPU: read a trace anywhere.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans if x < b and y > a)


def summarize(events: list[dict], top: int = 15) -> dict:
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    dev = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in xs if e.get("cat") in DEVICE_CATS]
    ranges: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in xs:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("cotserve:"):
            ranges[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    out: dict = {}
    if dev:
        busy = _union(dev)
        lo, hi = busy[0][0], busy[-1][1]
        busy_us = sum(b - a for a, b in busy)
        gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1) if busy[i + 1][0] > busy[i][1]]
        idle_us = sum(b - a for a, b in gaps)
        out.update(window_ms=round((hi - lo) / 1e3, 3), device_busy_ms=round(busy_us / 1e3, 3),
                   device_busy=round(busy_us / max(hi - lo, 1e-9), 4))
        out["device_idle"] = {
            "total_ms": round(idle_us / 1e3, 3), "gaps": len(gaps),
            "gaps_over_100us": sum(1 for a, b in gaps if b - a > 100),
            "longest_ms": round(max((b - a for a, b in gaps), default=0.0) / 1e3, 3),
            "while_in_range_ms": {name: round(sum(_overlap(merged, a, b) for a, b in gaps) / 1e3, 3)
                                  for name, merged in ((n, _union(s)) for n, s in sorted(ranges.items()))}}
    out["ranges"] = {name: {"count": len(spans), "total_ms": round(sum(b - a for a, b in spans) / 1e3, 3),
                            "median_ms": round(statistics.median(b - a for a, b in spans) / 1e3, 4),
                            "max_ms": round(max(b - a for a, b in spans) / 1e3, 3)}
                     for name, spans in sorted(ranges.items())}
    launches = sorted(float(e["ts"]) for e in xs if e.get("cat") == "cuda_runtime"
                      and "GraphLaunch" in str(e.get("name", "")))
    periods = [b - a for a, b in zip(launches, launches[1:], strict=False)]
    out["steps"] = {"graph_launches": len(launches)}
    if len(periods) >= 2:
        qs = statistics.quantiles(periods, n=10)
        out["steps"].update(period_median_ms=round(statistics.median(periods) / 1e3, 3),
                            period_p90_ms=round(qs[-1] / 1e3, 3))
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in xs:
        if e.get("cat") in DEVICE_CATS:
            per_kernel[str(e.get("name", ""))[:90]].append(float(e["dur"]))
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    out["kernels"] = [{"name": k, "count": len(v), "total_ms": round(sum(v) / 1e3, 3),
                       "mean_us": round(sum(v) / len(v), 2)} for k, v in ranked]
    return out


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: profile_summary.py TRACE.json[.gz] ...", file=sys.stderr)
        return 2
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        print(json.dumps({"trace": path.rsplit("/", 1)[-1], **summarize(events)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
