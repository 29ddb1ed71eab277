"""cotserve: serving middleware for chain-of-thought reasoning models."""

from __future__ import annotations

__version__ = "0.1.0"
