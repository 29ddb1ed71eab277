"""Errors a user can act on. The CLI prints them as one line; the gateway maps them to HTTP errors."""

from __future__ import annotations

import re

_PATH = re.compile(r"(?<![\w.:/])(?:~|\.{1,2})?(?:/[\w.+@=,-]+){2,}/?")


def redact_paths(text: str) -> str:
    """`text` with every file path shortened to its last part (messages sent to clients name no
    server paths)."""
    return _PATH.sub(lambda m: "<" + m.group(0).rstrip("/").rpartition("/")[2] + ">", text)


class CotserveError(Exception):
    """Base class: the message is meant for the user, no traceback needed."""


class ModelError(CotserveError):
    """A model name, folder or file that cannot be resolved or loaded."""


class PolicyError(CotserveError):
    """An unknown policy, a bad option, or a stack whose parts conflict."""


class RequestError(CotserveError):
    """A request the engine cannot serve as asked (e.g. prompt longer than the context)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code
