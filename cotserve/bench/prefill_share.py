"""Benchmark: n sequences of one prompt with the prefill shared (computed once, cache rows copied)
against one prefill per sequence, on the same engine, interleaved round-robin.

    python -m cotserve.bench.prefill_share --context 1024 --n 4 --rounds 5 --json out.json

Reports the prefill seconds (the engine's `prefill_s` telemetry) of each round and their medians,
and checks that both give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def run(model: str, context: int, n: int, new_tokens: int, rounds: int, device: str, dtype: str) -> dict[str, Any]:
    import torch

    from cotserve.bench.prompts import long_prompts
    from cotserve.engine.native import GenRequest, NativeEngine
    from cotserve.engine.sampling import SamplingParams
    from cotserve.models import load_model

    eng = NativeEngine(load_model(model, device=device, dtype=dtype), max_batch=n)
    (ids,) = long_prompts(eng.tokenizer, context, 1)
    rows: dict[str, list[float]] = {"shared": [], "separate": []}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for mode in ("shared", "separate") if r % 2 == 0 else ("separate", "shared"):
            eng.share_prefill = mode == "shared"
            reqs = [GenRequest(list(ids), SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for _ in range(n)]
            out = eng.generate(reqs)
            if r:
                rows[mode].append(out[0].telemetry["prefill_s"])
            print(f"round {r} {mode}: prefill {out[0].telemetry['prefill_s']} s", file=sys.stderr, flush=True)
            tokens[mode] = [o.token_ids for o in out]
    return {
        "bench": "prefill_share", "model": model, "device": str(eng.device), "dtype": str(eng.dtype),
        "context": len(ids), "n": n, "new_tokens": new_tokens, "rounds": rounds, "threads": torch.get_num_threads(),
        "prefill_s": rows, "median_prefill_s": {k: round(statistics.median(v), 4) for k, v in rows.items()},
        "same_tokens": tokens["shared"] == tokens["separate"],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    report = run(a.model, a.context, a.n, a.new_tokens, a.rounds, a.device, a.dtype)
    text = json.dumps(report, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
