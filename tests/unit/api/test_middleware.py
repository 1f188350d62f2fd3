"""GuardMiddleware on a bare ASGI app (no engine): framing limits and the body replay."""

import asyncio
import json

from services.api.auth import KeyChecker
from services.api.middleware import GuardMiddleware


async def echo_app(scope, receive, send):
    message = await receive()
    body = json.dumps({"got": len(message.get("body", b""))}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def call(mw, headers, chunks, path="/v1/chat/completions", delay_s=0.0):
    sent = []
    queue = list(chunks)

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        if not queue:
            await asyncio.sleep(3600)
        body = queue.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(queue)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(asyncio.wait_for(mw(scope, receive, send), 10))
    status = sent[0]["status"]
    return status, json.loads(sent[1]["body"]), dict(sent[0]["headers"])


def guard(**kw):
    base = dict(keys=KeyChecker([]), max_header_bytes=1024, max_body_bytes=100)
    return GuardMiddleware(echo_app, **{**base, **kw})


def test_body_is_replayed_whole_when_within_limits():
    status, body, _ = call(guard(), [(b"content-length", b"30")], [b"a" * 10, b"b" * 20])
    assert status == 200 and body == {"got": 30}


def test_declared_and_streamed_oversize_bodies_are_413_and_close():
    status, body, headers = call(guard(), [(b"content-length", b"101")], [b"x"])
    assert status == 413 and body["error"]["param"] == "max_body_bytes" and headers[b"connection"] == b"close"
    status, body, _ = call(guard(), [], [b"x" * 60, b"x" * 60])  # chunked: no Content-Length
    assert status == 413 and body["error"]["param"] == "max_body_bytes"


def test_slow_body_times_out_with_408():
    status, body, _ = call(guard(body_read_timeout_s=0.2), [], [b"x", b"y"], delay_s=0.5)
    assert status == 408 and body["error"]["param"] == "body_read_timeout"


def test_headers_and_keys_are_checked_before_the_body():
    status, body, _ = call(guard(), [(b"x-pad", b"a" * 2000)], [b"{}"])
    assert status == 431 and body["error"]["param"] == "max_header_bytes"
    status, body, _ = call(guard(keys=KeyChecker(["k"])), [], [b"{}"], path="/v1/messages")
    assert status == 401 and body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": body["error"]["message"]},
    }
