"""`python -m cotserve.bench.vllm_plan`: the host time of the CUDA SFI runtime's step plan
(`GraphSFI.refresh_due` + `GraphSFI.step`, what runs in vLLM's metadata builder every step) per
decode step, as JSON lines, at several batch sizes of SFI rows.

Every row is an SFI request past its prompt, decoding fast steps: the state is set up directly (the
bootstrap selections are not computed, and each row's refresh trigger is rewound so that no slow
step comes; a refresh's own time is `python -m cotserve.bench.vllm_parts`'s). On CUDA the time
includes the plan's launches and its pinned transfer; on a CPU it is the Python and torch host work.
Shapes: Qwen3-4B's attention (36 layers, 32/8 heads, head dim 128), SFI's defaults but k = 64 (the
plan does the same work whatever k is; the compact buffers stay small), 128 row slots (vLLM's largest
captured batch at 64 sequences).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch

from cotserve.policies.sfi.config import SFIConfig
from cotserve.vllm.batch_rows import BatchRows, RowRequest
from cotserve.vllm.graph_sfi import GraphSFI


def time_plan(rows: int, steps: int, device: torch.device, context: int = 16000, max_rows: int = 128) -> dict:
    layers, hq, hkv, d, bs = 36, 32, 8, 128, 16
    caches = [SimpleNamespace(kv_cache=torch.zeros(1, hkv, bs, 2 * d, dtype=torch.bfloat16, device=device))
              for _ in range(layers)]
    rt = GraphSFI(caches, hq, hkv, d, 0.088, torch.bfloat16, device, slots=max(rows, 1), max_rows=max_rows,
                  rows=BatchRows(), max_k=64)
    rt._warm = lambda cfg, slot=0: None  # the refresh kernels' compilation: no refresh runs here
    cfg = SFIConfig(k=64)  # the plan's host work does not depend on k; small compact buffers
    reqs = [RowRequest(prompt_ids=list(range(context)), output_ids=[], sfi=cfg) for _ in range(rows)]
    for i, r in enumerate(reqs):
        rt.rows.rows[i] = r
    blocks = torch.zeros(rows, context // bs + steps // bs + 2, dtype=torch.int32, device=device)
    lens = [context] * rows

    def step(ntok: int) -> None:
        cm = SimpleNamespace(num_reqs=rows, query_start_loc_cpu=torch.arange(rows + 1, dtype=torch.int32) * ntok,
                             block_table_tensor=blocks, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             max_query_len=ntok)
        rt.refresh_due(cm, bs)
        rt.step(cm, bs)

    step(context)  # the prompts (one chunk each)
    for r in reqs:  # steady state: selected, nothing due
        r.state.refresh_n = 0
        r.state.short = False

    def decode(n: int) -> float:
        host = 0.0
        for _ in range(n):
            for i, r in enumerate(reqs):
                r.output_ids.append(5)
                lens[i] += 1
                r.state.trigger.reset(r.state.steps)  # no slow step, no refresh
            t0 = time.perf_counter()
            step(1)
            host += time.perf_counter() - t0
        return host

    decode(20)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host = decode(steps)
    modes = rt.row_mode[:rows].tolist()
    return {"part": "step_plan", "device": device.type, "rows": rows, "steps": steps,
            "host_ms_per_step": round(host / steps * 1e3, 4), "fast_rows": sum(1 for m in modes if m == 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotserve.bench.vllm_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="4,16,32,64", help="batch sizes of SFI rows, separated by commas")
    ap.add_argument("--steps", type=int, default=300, help="decode steps timed at each size")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.rows.split(",") if x.strip()]
    except ValueError:
        print(f"vllm_plan: --rows takes batch sizes separated by commas, got {args.rows!r}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or max(sizes) > 128 or args.steps < 1:
        print("vllm_plan: batch sizes 1..128 and at least one step", file=sys.stderr)
        return 2
    for rows in sizes:
        print(json.dumps(time_plan(rows, args.steps, torch.device(args.device))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
