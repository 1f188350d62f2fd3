"""Error bodies in the two protocols' shapes, and the one exception the server raises.

Every client-caused rejection is an ``ApiError`` carrying the status, a message a user can
act on, and ``param``: the request field or the server limit (``ApiConfig`` field name)
that was violated. OpenAI-style bodies put it in ``error.param``; Anthropic-style bodies
have no such field, so the limit name is also part of the message.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "service_unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses. ``param`` names the field or limit at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def limit_error(limit: str, message: str, status: int = 400) -> ApiError:
    """A violated server limit: ``limit`` is the ApiConfig field name, quoted in the message."""
    return ApiError(status, f"{message} (limit: {limit})", param=limit, code="limit_exceeded")


def openai_body(err: ApiError) -> dict[str, Any]:
    etype = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": etype, "param": err.param, "code": err.code or etype}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    etype = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(err: ApiError, path: str) -> JSONResponse:
    body = anthropic_body(err) if is_anthropic_path(path) else openai_body(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def error_bytes(err: ApiError, path: str) -> bytes:
    """The body of ``error_response`` as bytes (for raw ASGI middleware)."""
    body = anthropic_body(err) if is_anthropic_path(path) else openai_body(err)
    return json.dumps(body).encode()


def from_recipe(status: int, body: str) -> ApiError:
    """Re-wrap a deepseek-recipe ``ConversionError`` (an OpenAI-style JSON body)."""
    try:
        inner = json.loads(body).get("error", {})
        message = str(inner.get("message") or body)
        param = inner.get("param")
    except (ValueError, AttributeError):
        message, param = body, None
    return ApiError(status if 400 <= status < 500 else 400, message, param=param)
