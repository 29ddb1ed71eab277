"""CPU threads for local evaluation: torch's intra-op pool is sized to physical cores, not to
hardware threads (two torch threads per process on a 2-core machine run at a third of the
speed of one when another process shares the cores)."""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo among the CPUs this process may use;
    `os.cpu_count()`-based when /proc/cpuinfo has no topology."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        blocks = []
    for block in blocks:
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines())}
        if "processor" not in fields:
            continue
        if allowed is not None and int(fields["processor"]) not in allowed:
            continue
        cores.add((fields.get("physical id", "0"), fields.get("core id", fields["processor"])))
    if cores:
        return len(cores)
    return len(allowed) if allowed else (os.cpu_count() or 1)


def default_threads(workers: int = 1) -> int:
    """Physical cores / workers, at least 1."""
    return max(1, physical_cores() // max(1, workers))


def set_threads(n: int | None, workers: int = 1) -> int:
    """Size torch's intra-op pool (None: the default above); returns the count set."""
    import torch

    n = default_threads(workers) if n is None else n
    if n < 1:
        from cotserve.errors import CotserveError

        raise CotserveError("--threads must be at least 1")
    torch.set_num_threads(n)
    return n
