"""The request path shared by every generation endpoint.

1. settle the traffic class (API key, ``X-Sluice-Traffic-Class``, else chat; a bad header
   is a 400), parse the JSON body and run the cheap limit checks (``limits.check_body``);
2. take an admission slot (429 + Retry-After when full);
3. convert and tokenise with recipe (in a worker thread: tokenising is CPU work);
4. generate: SSE through ``StreamingResponse`` once the first token is out (Starlette
   cancels it when the client disconnects), or one JSON body; until the response starts,
   a watcher cancels the generation if the client disconnects. Either way the engine
   request is aborted on cancellation.
The slot is released when the response has been sent or abandoned, never earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.api.admission import AdmissionController
from services.api.config import ApiConfig
from services.api.convert import Converter, Kind
from services.api.engine_client import EngineBusy, EngineClient, EngineRequestError, EngineUnavailable
from services.api.errors import ApiError
from services.api.limits import check_body, parse_json_object
from services.api.metrics import ApiMetrics
from services.api.streaming import Generation
from services.api.traffic_class import STATE_KEY, TRAFFIC_CLASS_HEADER, resolve_traffic_class

T = TypeVar("T")


@dataclass
class ServerState:
    config: ApiConfig
    engine: EngineClient
    converter: Converter
    admission: AdmissionController
    metrics: ApiMetrics


class _SlotStreamingResponse(StreamingResponse):
    """Releases the admission slot when the stream ends, fails or is cancelled."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _until_disconnect(request: Request, work: Coroutine[Any, Any, T], state: ServerState) -> T:
    """Run ``work``; cancel it (aborting the engine request) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        state.metrics.disconnects.inc()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "client disconnected", code="client_disconnected")
    return task.result()


async def handle_generation(request: Request, kind: Kind, endpoint: str) -> Response:
    state: ServerState = request.app.state.sluice
    state.admission.reject_if_full()  # overload is refused before any parsing
    traffic_class = resolve_traffic_class(
        request.headers.get(TRAFFIC_CLASS_HEADER), getattr(request.state, STATE_KEY, None)
    )
    raw = await request.body()
    body = parse_json_object(raw)
    await asyncio.to_thread(check_body, body, kind, state.config, state.converter.image_cache)
    await state.admission.acquire()
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.admission.release()

    streaming = False
    try:
        prep = await asyncio.to_thread(state.converter.prepare, kind, raw, body, traffic_class)
        gen = Generation(
            prep,
            state.engine,
            state.converter.tokenizer,
            state.metrics,
            endpoint,
            state.config.request_timeout_s,
        )
        if prep.stream:
            # Headers go out with the first token: a request the engine refuses (a grammar it
            # cannot compile, a prompt its cache cannot hold) still gets a proper 4xx.
            await _until_disconnect(request, gen.prime(), state)
            response = _SlotStreamingResponse(
                gen.sse(), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, on_close=release,
            )  # fmt: skip
            streaming = True
            state.metrics.requests.labels(endpoint=endpoint, status="200").inc()
            return response
        text = await _until_disconnect(request, gen.full_json(), state)
        state.metrics.latency.labels(endpoint=endpoint).observe(time.monotonic() - gen.started)
        state.metrics.requests.labels(endpoint=endpoint, status="200").inc()
        return Response(text, media_type="application/json")
    except EngineRequestError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    except EngineBusy as exc:
        raise ApiError(503, str(exc), code="engine_busy", headers={"Retry-After": "1"}) from None
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"}) from None
    finally:
        if not streaming:
            release()
