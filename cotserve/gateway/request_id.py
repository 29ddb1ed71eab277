"""`X-Request-Id`: a client's id for a request, carried through the queue to the worker.

An incoming `X-Request-Id` (up to 128 printable characters, no spaces) is kept as the request's
id; any other request gets a fresh one. Every response carries it back in `X-Request-Id`, the job
carries it to the worker (`Job.client_request_id`), and the gateway's and the worker's log lines
of the request both name it beside the job id, so their lines can be matched."""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import Request

HEADER = b"x-request-id"
_VALID = re.compile(r"^[\x21-\x7e]{1,128}$")


def clean(value: str | None) -> str | None:
    """The client's id when it is acceptable, else None."""
    return value if value is not None and _VALID.match(value) else None


def request_id_of(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


class RequestId:
    """Pure ASGI: sets `scope["state"]["request_id"]` and echoes it in the response headers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k.lower() == HEADER), None)
        rid = clean(given.decode("latin-1") if given is not None else None) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode("latin-1")

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, raw)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
