"""The HTTP framing guard: header size, API key, body size, body read time (raw ASGI).

Runs before routing and before any body byte is parsed, in the cheapest order:
1. total header bytes > ``max_header_bytes`` -> 431 (uvicorn's h11 parser refuses
   anything past twice that before the app sees it, with a plain 400);
2. API key (every path but /health) -> 401; the matched key's traffic class, if it has
   one, goes into the scope's ``state`` for the route (``traffic_class.STATE_KEY``);
3. ``Content-Length`` > ``max_body_bytes`` -> 413 without reading the body;
4. the body is read with a running count (chunked uploads have no Content-Length) and
   a read deadline; past the limit -> 413, past the deadline -> 408.
The buffered body is replayed to the app, so handlers read it as usual.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.api.auth import KeyChecker
from services.api.errors import ApiError, error_bytes, limit_error
from services.api.traffic_class import STATE_KEY

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
OnReject = Callable[[str, str], None]  # (reason, path)

BODY_READ_TIMEOUT_S = 30.0


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyChecker,
        max_header_bytes: int,
        max_body_bytes: int,
        on_reject: OnReject | None = None,
        body_read_timeout_s: float = BODY_READ_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.keys = keys
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            headers = self._check_headers(scope)
            key_class = self.keys.check(path, headers)
            if key_class is not None:  # the route reads it as request.state.<STATE_KEY>
                scope.setdefault("state", {})[STATE_KEY] = key_class
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await self._read_body(headers, receive)
                receive = _replay(body, receive)
        except ApiError as err:
            if self.on_reject is not None:
                self.on_reject(err.param or err.code or str(err.status), path)
            await _send_error(send, err, path)
            return
        await self.app(scope, receive, send)

    def _check_headers(self, scope: Scope) -> dict[str, str]:
        raw = scope.get("headers") or []
        size = sum(len(k) + len(v) + 4 for k, v in raw)
        if size > self.max_header_bytes:
            raise limit_error(
                "max_header_bytes",
                f"request headers are {size} bytes, more than {self.max_header_bytes}",
                431,
            )
        return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "Content-Length is not a number", param="content-length")
            if int(declared) > self.max_body_bytes:
                raise limit_error(
                    "max_body_bytes", f"body of {declared} bytes exceeds {self.max_body_bytes} bytes", 413
                )
        chunks: list[bytes] = []
        total = 0
        deadline = time.monotonic() + self.body_read_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                raise ApiError(408, "request body not received in time", param="body_read_timeout") from None
            if message["type"] == "http.disconnect":
                raise ApiError(400, "client disconnected while sending the body", param="body")
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise limit_error("max_body_bytes", f"body exceeds {self.max_body_bytes} bytes", 413)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later reads wait for http.disconnect, as uvicorn's do

    return replay


async def _send_error(send: Send, err: ApiError, path: str) -> None:
    body = error_bytes(err, path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if err.status in (408, 413, 431):
        headers.append((b"connection", b"close"))  # the unread body must not be parsed as a request
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
