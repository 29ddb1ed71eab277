"""cotserve: serving middleware for chain-of-thought reasoning models."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# In a source checkout, kernels/ and eval/ sit next to this package and are importable as
# cotserve.kernels / cotserve.eval (setup.py maps them the same way for installed copies).
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
if (_SOURCE_ROOT / "pyproject.toml").is_file() and (_SOURCE_ROOT / "kernels").is_dir():
    __path__.append(str(_SOURCE_ROOT))  # type: ignore[name-defined]  # noqa: F821

SOURCE_ROOT = _SOURCE_ROOT
