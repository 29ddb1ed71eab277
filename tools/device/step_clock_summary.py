"""Where each stretch of a served run's steps went: `python tools/device/step_clock_summary.py
sfi-telemetry.jsonl` (the file `COTSERVE_VLLM_TELEMETRY` names) prints one JSON line per stretch
between the step clock's idle gaps (a load generator's runs are such stretches; a stretch with fewer
than `--min-steps` (50) decode-only steps, a warm-up's, is left out):

* `prompt_steps`, `prompt_ms` (mean): steps that carried prompt tokens;
* `refresh`, `slow`, `sfi`: SFI's decode-only steps (refreshes run before the forward; else a slow row;
  else SFI rows only), each `[count, mean ms]`;
* `dense`: the other decode-only steps (no SFI row: dense requests), `[count, mean ms]`;
* `decode_s`: all decode-only steps' time; `prompt_s`: the prompt-carrying steps' time;
* `prompt_share`: `prompt_s` over both: the part of the engine's time a decode-only speed-up (SFI's)
  leaves as it is (a bound on what it can gain end to end: 1 / prompt_share).

The counters are cumulative (`cotserve/vllm/step_clock.py`) and the line an idle gap writes holds them
as the gap found them: a stretch is the difference between two such lines (requests' lines written
meanwhile are inside it). Lines written before the
`decode_sfi_steps` counter existed leave SFI's other steps inside `dense`. Any machine, no GPU.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

KINDS = {"refresh": "decode_refresh_steps", "slow": "decode_slow_steps", "sfi": "decode_sfi_steps"}


def stretches(lines: Iterable[str], min_steps: int = 50) -> list[dict]:
    """The per-stretch summaries of a telemetry file's lines."""
    clocks = [c for c in (json.loads(line).get("step_clock") for line in lines if line.strip()) if c]
    if not clocks:
        return []
    gaps = [0] + [c["idle_gaps"] for c in clocks]
    bounds = [c for c, before in zip(clocks, gaps, strict=False) if c["idle_gaps"] > before]  # the gaps' lines
    out, start = [], {k: 0 for k in clocks[0]}
    for end in [*bounds, clocks[-1]]:
        d = {k: end.get(k, 0) - start.get(k, 0) for k in end}
        start = end
        if d["decode_steps"] < min_steps:
            continue
        row: dict = {"prompt_steps": d["prompt_steps"],
                     "prompt_ms": _ms(d["prompt_steps_s"], d["prompt_steps"])}
        n_left, s_left = d["decode_steps"], d["decode_steps_s"]
        for name, key in KINDS.items():
            n, s = d.get(key, 0), d.get(key + "_s", 0.0)
            row[name] = [n, _ms(s, n)]
            n_left, s_left = n_left - n, s_left - s
        row["dense"] = [n_left, _ms(s_left, n_left)]
        row["decode_s"] = round(d["decode_steps_s"], 3)
        row["prompt_s"] = round(d["prompt_steps_s"], 3)
        busy = d["prompt_steps_s"] + d["decode_steps_s"]
        row["prompt_share"] = round(d["prompt_steps_s"] / busy, 3) if busy else 0.0
        out.append(row)
    return out


def _ms(seconds: float, n: int) -> float:
    return round(1000.0 * seconds / n, 2) if n else 0.0


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: step_clock_summary.py TELEMETRY.jsonl [--min-steps N]", file=sys.stderr)
        return 2
    min_steps = int(argv[argv.index("--min-steps") + 1]) if "--min-steps" in argv else 50
    with open(argv[0]) as f:
        for row in stretches(f, min_steps):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
