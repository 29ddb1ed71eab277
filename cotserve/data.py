"""Where datasets are found: --data-dir, else $COTSERVE_DATA_DIR, else ../shared/datasets
next to a source checkout. Datasets are never shipped with the package."""

from __future__ import annotations

import os
from pathlib import Path

from cotserve.errors import CotserveError

# The checkout this module runs from (in an installed copy, site-packages' parent: no datasets there).
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def data_dir(explicit: str | None = None, required: bool = True) -> Path | None:
    candidates = [explicit, os.environ.get("COTSERVE_DATA_DIR"), str(SOURCE_ROOT.parent / "shared" / "datasets")]
    for c in candidates:
        if c and Path(c).expanduser().is_dir():
            return Path(c).expanduser()
    if explicit:
        raise CotserveError(f"data directory {explicit} does not exist")
    if required:
        raise CotserveError("no data directory: pass --data-dir or set COTSERVE_DATA_DIR")
    return None
