"""Errors a user can act on. The CLI prints them as one line; the gateway maps them to HTTP errors."""

from __future__ import annotations


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
