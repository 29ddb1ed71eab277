"""`python -m cotserve.bench.tune_sfi_fast --out FILE`: measure SFI's fast-step kernel under several
launches at each batch size on this GPU and write the launch table `kernels.sfi_launch` reads
(JSON: the chosen launch per batch size, and every timing).

Each launch is timed replayed from a CUDA graph (as inside vLLM's captured decode step), on random
compact buffers and a scattered paged cache of the given shape (default: Qwen3-4B's attention, SFI's
default k = 2,048 and 256-entry window, 16,384-entry contexts, 16-entry blocks). A batch size keeps
the heuristic launch (`sfi_launch.heuristic_splits`, 64 entries a block, 4 warps, 3 stages) unless
another is at least `--margin` faster. First each size's heuristic split count is tried with every
block/warp/stage candidate, then the best of those with other split counts. `--deadline` seconds
bound the whole search (sizes not reached keep the heuristic). Ship a table for a device as
`cotserve/kernels/configs/sfi_fast/<device name>.json`, or point $COTSERVE_SFI_FAST_CONFIG at it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from cotserve.bench.vllm_parts import RING_WRITES
from cotserve.kernels.sfi_launch import FastLaunch, heuristic_splits
from cotserve.policies.options import SFIOptions, option_default

SHAPES = (8, 4, 128, 2112, 256, 16384, 16)  # KV heads, group, head dim, compact entries, window, context, block
BLOCKS = ((64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 2),
          (32, 4, 3), (32, 4, 4))  # (entries a block, warps, stages)
SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
ROWS = (16, 32, 8, 24, 4, 48, 64, 2, 1)  # the most served first: a deadline cuts the tail


class Inputs:
    """Random kernel inputs for `rows` rows (bf16, vLLM's FlashAttention cache layout)."""

    def __init__(self, rows: int, hkv: int, g: int, d: int, c: int, window: int, context: int, bs: int):
        dev = torch.device("cuda")
        nb = rows * (context // bs + 1)
        self.q = torch.randn(rows, hkv * g, d, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.ck = torch.randn(rows, hkv, c, d, device=dev, dtype=torch.bfloat16)
        self.cv = torch.randn_like(self.ck)
        self.cpos = torch.randint(0, context - window, (rows, hkv, c), device=dev, dtype=torch.int32)
        kv = torch.randn(nb, hkv, bs, 2 * d, device=dev, dtype=torch.bfloat16)
        self.kc, self.vc = kv.transpose(1, 2).split(d, dim=-1)
        self.bt = torch.randperm(nb, device=dev)[: rows * (context // bs)].view(rows, -1).to(torch.int32)
        self.mode = torch.ones(rows, dtype=torch.int32, device=dev)
        self.slot = torch.arange(rows, dtype=torch.int32, device=dev)
        self.lens = torch.full((rows,), context, dtype=torch.int32, device=dev)
        self.ws = self.lens - window
        # the decode step's ring writes, done by the same launch: each row's query into its slot's ring
        self.ring = torch.zeros(rows + 1, 32, hkv * g, d, device=dev, dtype=torch.bfloat16)
        writes = torch.arange(RING_WRITES, device=dev)
        self.w_tok = writes % rows
        self.w_slot = torch.where(writes < rows, self.w_tok, rows)  # the rest to the scratch slot
        self.w_idx = torch.zeros_like(writes)
        # as served: each slot's compact entries in use (SFI's sinks + k), the padding to c unread
        used = min(c, option_default(SFIOptions, "sinks") + option_default(SFIOptions, "k"))
        self.count = torch.full((rows,), used, dtype=torch.int32, device=dev)
        self.bytes = rows * hkv * (used + window) * d * 2 * 2  # the compact entries read + window, keys and values

    def run(self, launch: FastLaunch) -> None:
        from cotserve.kernels.sfi_paged import sfi_paged_fast

        sfi_paged_fast(self.q, self.out, self.ck, self.cv, self.cpos, self.kc, self.vc, self.bt, self.mode, self.slot,
                       self.slot, self.ws, self.lens, 0.088, launch=launch,
                       ring=(self.ring, self.w_tok, self.w_slot, self.w_idx), ccount=self.count)


def time_us(inputs: Inputs, launch: FastLaunch) -> float:
    from cotserve.bench.vllm_parts import graph_ms

    return graph_ms(lambda: inputs.run(launch)) * 1000.0


def tune(rows_list: tuple[int, ...], shape: tuple[int, ...], deadline_s: float, margin: float) -> dict:
    hkv = shape[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.monotonic()
    launches: dict[str, dict] = {}
    measured: list[dict] = []
    for rows in rows_list:
        base = FastLaunch(splits=heuristic_splits(rows, hkv, sms))
        if time.monotonic() - t0 > deadline_s:
            launches[str(rows)] = {**base.as_dict(), "tuned": False}
            continue
        inputs = Inputs(rows, *shape)
        seen: dict[FastLaunch, float] = {}

        def trial(launch: FastLaunch, inputs=inputs, seen=seen, rows=rows) -> None:
            if launch in seen or time.monotonic() - t0 > deadline_s:
                return
            try:
                us = time_us(inputs, launch)
            except Exception as exc:  # a launch this GPU cannot take (shared memory): not a candidate
                measured.append({"rows": rows, **launch.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:200]})
                return
            seen[launch] = us
            measured.append({"rows": rows, **launch.as_dict(), "us": round(us, 2),
                             "GB/s": round(inputs.bytes / us / 1e3, 1)})

        trial(base)
        for bn, w, st in BLOCKS:
            trial(FastLaunch(base.splits, bn, w, st))
        if base not in seen:  # the heuristic launch itself failed or the deadline came: nothing to compare
            launches[str(rows)] = {**base.as_dict(), "tuned": False}
            continue
        best = min(seen, key=seen.get)
        for ns in SPLITS:
            if rows * hkv * ns <= 8 * sms:  # beyond ~8 programs a multiprocessor a split only adds a combine
                trial(replace(best, splits=ns))
        best = min(seen, key=seen.get)
        chosen = best if seen[best] < (1.0 - margin) * seen[base] else base
        launches[str(rows)] = {**chosen.as_dict(), "us": round(seen[chosen], 2), "heuristic_us": round(seen[base], 2),
                               "tuned": True}
        del inputs
        torch.cuda.empty_cache()
    return {"launches": launches, "measured": measured, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotserve.bench.tune_sfi_fast", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the launch table to write (JSON)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="batch sizes to tune, most important first")
    ap.add_argument("--context", type=int, default=SHAPES[5], help="entries in each row's paged history")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds the whole search may take")
    ap.add_argument("--margin", type=float, default=0.03, help="how much faster a launch must be than the heuristic's")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_sfi_fast: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        rows = tuple(int(r) for r in args.rows.split(",") if r.strip())
    except ValueError:
        print(f"tune_sfi_fast: --rows takes batch sizes separated by commas, got {args.rows!r}", file=sys.stderr)
        return 2
    if not rows or min(rows) < 1:
        print("tune_sfi_fast: --rows needs batch sizes of at least 1", file=sys.stderr)
        return 2
    shape = (*SHAPES[:5], args.context, SHAPES[6])
    result = tune(rows, shape, args.deadline, args.margin)
    names = ("kv_heads", "group", "head_dim", "compact", "window", "context", "block_size")
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": dict(zip(names, shape, strict=True)),
           "margin": args.margin, **result}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r, v in doc["launches"].items():
        print(json.dumps({"rows": int(r), **v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
