"""Errors a user can act on. The CLI prints them as one line; the gateway maps them to HTTP errors."""

from __future__ import annotations

import re

# An absolute, home or relative-to-here path of two parts or more (or a file:// URL); not a URL's
# path (after "host"), nor a route of the API (/v1/...).
_PATH = re.compile(r"(?<![\w.:/])(?!/v1/)(?:file://|~|\.{1,2})?(?:/[\w.+@=,-]+){2,}/?")


def redact_paths(text: str) -> str:
    """`text` with every file path shortened to its last part, `<name>` (messages sent to clients
    name no server paths; the server log keeps them whole)."""
    return _PATH.sub(lambda m: "<" + m.group(0).rstrip("/").rpartition("/")[2] + ">", text)


class CotserveError(Exception):
    """Base class: the message is meant for the user, no traceback needed."""


class ModelError(CotserveError):
    """A model name, folder or file that cannot be resolved or loaded."""


class PolicyError(CotserveError):
    """An unknown policy, a bad option, or a stack whose parts conflict."""


class EngineDead(CotserveError):
    """The engine stopped serving for good (vLLM's engine process died): the worker hands back
    or fails what it held, then restarts its engine or exits."""


class RequestError(CotserveError):
    """A request the engine cannot serve as asked (e.g. prompt longer than the context)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code
