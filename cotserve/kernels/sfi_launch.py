"""How SFI's fast-step kernel (`kernels.sfi_paged`) is launched at each batch size: its splits per
(row, KV head), the entries a program reads per block, its warps and its software-pipeline stages.

The launch changes the time, never the result (beyond float rounding from a different split).
Without a table the rule is `heuristic_splits` with Triton's usual launch (64 entries a block, 4 warps,
3 stages). A table, measured on a GPU by `python -m cotserve.bench.tune_sfi_fast`, maps batch sizes
to launches; a batch uses the entry of the largest tuned size not above it (the smallest tuned size
below that). Where the table comes from:

* `$COTSERVE_SFI_FAST_CONFIG`: a path to such a JSON file (an unreadable or malformed file is an
  error at the first launch, not a silent fallback);
* else the one shipped for the device's name, `kernels/configs/sfi_fast/<name>.json` (spaces and
  slashes as `_`), where there is one;
* else none.

`$COTSERVE_SFI_SPLITS` (a number) fixes the splits whatever the table says.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs" / "sfi_fast"
ENV_TABLE = "COTSERVE_SFI_FAST_CONFIG"
ENV_SPLITS = "COTSERVE_SFI_SPLITS"


@dataclass(frozen=True, order=True)
class FastLaunch:
    """One launch of the fast-step kernel (splits 1: the single-pass kernel)."""

    splits: int = 1
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.splits < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"a fast-step launch needs positive splits, warps and stages: {self}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"a fast-step launch reads a power of two of at least 16 entries a block: {self}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def heuristic_splits(rows: int, kv_heads: int, multiprocessors: int) -> int:
    """About two programs per multiprocessor, at most 16 splits, so that a small batch still fills
    the GPU (one program per (row, KV head) reads its ~2,300 entries one block after another,
    latency-bound); 1 once the batch alone gives two programs a multiprocessor."""
    work = rows * kv_heads
    return 1 if work >= 2 * multiprocessors else min(16, max(2, -(-2 * multiprocessors // work)))


def device_file(name: str) -> Path:
    """The shipped table's path for a device name."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_") + ".json")


@dataclass(frozen=True)
class LaunchTable:
    """A launch table: batch size -> launch, and the shape it was measured on (`kv_heads`, `head_dim`, ...;
    empty: any)."""

    launches: dict[int, FastLaunch]
    shape: dict = field(default_factory=dict)

    def fits(self, kv_heads: int, head_dim: int | None) -> bool:
        """Whether it applies to a model of these KV heads and head dim (a table that names neither
        applies to any)."""
        return (self.shape.get("kv_heads", kv_heads) == kv_heads
                and (head_dim is None or self.shape.get("head_dim", head_dim) == head_dim))

    def pick(self, rows: int) -> FastLaunch:
        """The entry of the largest tuned batch size <= rows (the smallest tuned size when none is)."""
        below = [r for r in self.launches if r <= rows]
        return self.launches[max(below) if below else min(self.launches)]


def parse_table(data: dict, source: str) -> LaunchTable:
    """`{"shape": {"kv_heads": 8, "head_dim": 128, ...}, "launches": {"16": {"splits": 3, "block_n": 64,
    "num_warps": 4, "num_stages": 3, ...}}}` (other keys ignored; `shape` optional) -> a `LaunchTable`."""
    try:
        launches = data["launches"]
        table = {int(rows): FastLaunch(**{k: int(v[k]) for k in ("splits", "block_n", "num_warps", "num_stages")})
                 for rows, v in launches.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a fast-step launch table ({type(exc).__name__}: {exc})") from None
    if not table or min(table) < 1:
        raise ValueError(f"{source}: a launch table needs batch sizes of at least 1")
    shape = data.get("shape")
    return LaunchTable(table, dict(shape) if isinstance(shape, dict) else {})


_TABLES: dict[tuple[str, str], LaunchTable | None] = {}


def launch_table(device: torch.device) -> LaunchTable | None:
    """The table for `device` ($COTSERVE_SFI_FAST_CONFIG, else the shipped one), read once."""
    given = os.environ.get(ENV_TABLE, "")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    key = (given, name)
    if key not in _TABLES:
        path = Path(given) if given else device_file(name) if name else None
        if path is None or (not given and not path.is_file()):
            _TABLES[key] = None
        else:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"${ENV_TABLE}: cannot read a launch table from {path.name} "
                                 f"({type(exc).__name__})") from None
            _TABLES[key] = parse_table(data, path.name)
    return _TABLES[key]


_CHOSEN: dict[tuple, FastLaunch] = {}


def fast_launch(rows: int, kv_heads: int, device: torch.device, head_dim: int | None = None) -> FastLaunch:
    """The launch for a batch of `rows` rows on `device` (CPU: the single-pass kernel); decided once
    per batch size, shape, device and environment (an eager step asks at every layer). A table
    measured for other KV heads or head dim than the model's is not used (the heuristic is)."""
    if device.type != "cuda":
        return FastLaunch()
    key = (rows, kv_heads, head_dim, device, os.environ.get(ENV_TABLE, ""), os.environ.get(ENV_SPLITS, "auto"))
    if key not in _CHOSEN:
        _CHOSEN[key] = _decide(rows, kv_heads, head_dim, device)
    return _CHOSEN[key]


def _decide(rows: int, kv_heads: int, head_dim: int | None, device: torch.device) -> FastLaunch:
    table = launch_table(device)
    if table is not None and table.fits(kv_heads, head_dim):
        launch = table.pick(rows)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        launch = FastLaunch(splits=heuristic_splits(rows, kv_heads, sms))
    fixed = os.environ.get(ENV_SPLITS, "auto")
    if fixed != "auto":
        launch = FastLaunch(max(1, int(fixed)), launch.block_n, launch.num_warps, launch.num_stages)
    return launch
