"""Where datasets are found: --data-dir, else $COTSERVE_DATA_DIR, else ../shared/datasets
next to a source checkout. Datasets are never shipped with the package.

A folder named explicitly (--data-dir or $COTSERVE_DATA_DIR) must exist: a missing one is an
error, never a fallback to the next place (a typo must not silently read other data)."""

from __future__ import annotations

import os
from pathlib import Path

from cotserve.errors import CotserveError

ENV = "COTSERVE_DATA_DIR"

# The checkout this module runs from (in an installed copy, site-packages' parent: no datasets there).
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def data_dir(explicit: str | None = None, required: bool = True) -> Path | None:
    """The dataset folder; `required=False` gives None when none is configured and the
    checkout's default is absent (a named folder that does not exist is an error either way)."""
    for given, name in ((explicit, "--data-dir"), (os.environ.get(ENV), f"${ENV}")):
        if given:
            path = Path(given).expanduser()
            if not path.is_dir():
                what = "is not a directory" if path.exists() else "does not exist"
                raise CotserveError(f"{name} {given} {what}")
            return path
    default = SOURCE_ROOT.parent / "shared" / "datasets"
    if default.is_dir():
        return default
    if required:
        raise CotserveError(f"no data directory: pass --data-dir or set {ENV}")
    return None
