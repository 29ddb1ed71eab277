"""The gateway's outer layer (pure ASGI, before routing and body parsing).

For every POST to an API route it checks, in this order and before the body is parsed:

1. the API key (401 without reading the body);
2. the body size: a `Content-Length` over `max_body_bytes` answers 413 at once, a body sent
   without one is read up to the limit (413 past it);
3. that the body is standard JSON: the constants `NaN`, `Infinity` and `-Infinity` (which
   Python's json module accepts) are refused with 400, so no non-finite number reaches the
   service.

It also turns an unexpected exception of a route into a 500 in OpenAI's error shape that names
no file or value and leaves the keep-alive connection usable (Starlette's own handler re-raises
the exception to the server, which then drops the connection).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from cotserve.gateway.auth import check_key
from cotserve.gateway.errors import APIError

log = logging.getLogger("cotserve.gateway")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# Routes that take a JSON body (the ones that need a key when keys are configured).
BODY_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_json(body: bytes) -> None:
    """Raise ValueError when `body` is not standard JSON (NaN / Infinity included)."""
    json.loads(body, parse_constant=_refuse_constant)


class Guard:
    def __init__(self, app, api_keys: list[str], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_status: Callable[[str, int], None] | None = None):
        self.app = app
        self.api_keys = list(api_keys)
        self.max_body_bytes = int(max_body_bytes)
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            if scope.get("method") == "POST" and scope.get("path", "") in BODY_PATHS:
                receive = await self._checked(scope, receive, tracked_send)
                if receive is None:
                    return
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # a response is already under way: the server ends it
            self._count(scope, 500)
            await self._send(send, APIError(500, "internal server error; the server log has the details",
                                            code="internal_error"))

    def _count(self, scope: Scope, status: int) -> None:
        if self.on_status is not None:
            self.on_status(scope.get("path", ""), status)

    async def _send(self, send: Send, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Key, size and JSON checks; a receive that replays the body, or None after an error reply."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not check_key(headers.get("authorization"), self.api_keys):
            await self._reject(scope, send, APIError(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}))
            return None
        too_big = APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} "
                                "bytes", code="request_too_large")
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await self._reject(scope, send, APIError(400, "invalid Content-Length header", code="invalid_value"))
                return None
            if n > self.max_body_bytes:
                await self._reject(scope, send, too_big)
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(scope, send, too_big)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            check_json(body)
        except ValueError:
            await self._reject(scope, send, APIError(400, "the request body is not valid JSON", code="invalid_json"))
            return None
        done = False

        async def replay() -> Message:
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    async def _reject(self, scope: Scope, send: Send, err: APIError) -> None:
        self._count(scope, err.status)
        await self._send(send, err)
