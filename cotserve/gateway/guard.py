"""The gateway's outer layer (pure ASGI, before routing and body parsing).

Every request first has its headers counted: more than `max_headers` of them, or more than
`max_header_bytes` of names and values together, answer 431 (the HTTP server in front reads
headers without a limit of its own). A request for a key-protected page (`/metrics` and the API
docs when the server has keys and they are not public: `key_paths`) without a valid key gets 401.

For every POST to an API route it checks, in this order and before the body is parsed:

1. the API key (401 without reading the body);
2. the body size: a `Content-Length` over `max_body_bytes` answers 413 at once, a body sent
   without one is read up to the limit (413 past it);
3. that the body is standard JSON nested at most `MAX_JSON_DEPTH` levels deep: the constants
   `NaN`, `Infinity` and `-Infinity` (which Python's json module accepts) are refused with 400,
   so no non-finite number reaches the service, and so is deeper nesting (it would exhaust the
   parsers' recursion further in).

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
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # names and values of all headers together
DEFAULT_MAX_HEADERS = 256
MAX_JSON_DEPTH = 128  # arrays and objects nested in a request body

# Routes that take a JSON body (the ones that need a key when keys are configured).
BODY_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")


class JSONTooDeep(ValueError):
    """A JSON body nested more than `MAX_JSON_DEPTH` levels deep."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def json_depth(value: Any, limit: int) -> int:
    """How deeply arrays and objects nest in `value` (0 for a scalar), counted up to `limit + 1`."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest


def check_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ValueError when `body` is not standard JSON (NaN / Infinity included), JSONTooDeep
    when it nests more than `max_depth` levels."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:  # nested past the parser's own recursion limit
        raise JSONTooDeep(f"nested more than {max_depth} levels") from None
    if json_depth(value, max_depth) > max_depth:
        raise JSONTooDeep(f"nested more than {max_depth} levels")


class Guard:
    def __init__(self, app, api_keys: list[str], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_status: Callable[[str, int], None] | None = None,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_headers: int = DEFAULT_MAX_HEADERS,
                 key_paths: tuple[str, ...] = ()):
        self.app = app
        self.api_keys = list(api_keys)
        self.max_body_bytes = int(max_body_bytes)
        self.max_header_bytes = int(max_header_bytes)
        self.max_headers = int(max_headers)
        self.key_paths = tuple(key_paths) if self.api_keys else ()
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = self._headers_too_large(scope.get("headers", []))
        if too_large:
            await self._reject(scope, send, APIError(431, too_large, code="request_header_fields_too_large"))
            return
        if scope.get("path", "") in self.key_paths and not check_key(self._header(scope, b"authorization"),
                                                                     self.api_keys):
            await self._reject(scope, send, self._no_key())
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

    def _headers_too_large(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """Why the request's headers are refused (431), or None."""
        if len(headers) > self.max_headers:
            return f"the request has {len(headers)} headers; this server takes at most {self.max_headers}"
        size = sum(len(k) + len(v) for k, v in headers)
        if size > self.max_header_bytes:
            return (f"the request's headers hold {size} bytes; this server takes at most {self.max_header_bytes} "
                    "bytes of header names and values")
        return None

    @staticmethod
    def _header(scope: Scope, name: bytes) -> str | None:
        for k, v in scope.get("headers", []):
            if k.lower() == name:
                return v.decode("latin-1")
        return None

    @staticmethod
    def _no_key() -> APIError:
        return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

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
            await self._reject(scope, send, self._no_key())
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
        except JSONTooDeep:
            await self._reject(scope, send, APIError(
                400, f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                code="invalid_json"))
            return None
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
