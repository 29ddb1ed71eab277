"""Progress lines on stderr for benchmarks that run longer than a few seconds; stdout keeps the JSON.

    note = Progress("fidelity")
    note("model loaded")          # -> "[fidelity   3.2 s] model loaded" on stderr

`COTSERVE_BENCH_QUIET=1` silences them."""

from __future__ import annotations

import os
import sys
import time


class Progress:
    def __init__(self, name: str, stream=None) -> None:
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.on = os.environ.get("COTSERVE_BENCH_QUIET", "") not in ("1", "true", "yes")
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.on:
            print(f"[{self.name} {time.perf_counter() - self.t0:6.1f} s] {message}", file=self.stream, flush=True)
