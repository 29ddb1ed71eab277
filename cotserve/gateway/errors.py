"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         431: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type_ or TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _loc(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "int", "float", "bool"):
            continue  # pydantic's union branch names
        else:
            out += ("." if out else "") + str(part)
    return out


def _count(request: Request, status: int) -> None:
    """Error statuses of chat completions go to the requests counter (when the app has metrics)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and request.url.path.endswith("/chat/completions"):
        metrics.requests.labels(str(status)).inc()


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        _count(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        _count(request, 400)
        errs = exc.errors()
        if not errs:
            return APIError(400, "invalid request body").response()
        e = errs[0]
        param = _loc(tuple(e.get("loc", ()))) or None
        if e.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        msg = e.get("msg", "invalid value")
        return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()
