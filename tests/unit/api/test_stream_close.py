"""A client gone mid-stream: the engine stream is closed (and its request aborted) even when
the cancellation is delivered again and again, as anyio's cancel scopes do (starlette cancels
a streaming response's task that way when the client disconnects)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from types import SimpleNamespace

import anyio

from services.api.streaming import Generation


def test_a_repeatedly_cancelled_stream_still_runs_its_engine_cleanup() -> None:
    events: list[str] = []

    async def engine_stream():
        try:
            yield 1
            await asyncio.sleep(60)  # the engine works on the next token
            yield 2
        finally:
            await asyncio.sleep(0.05)  # the abort travels to the engine (a remote call)
            events.append("aborted")

    async def consume() -> None:
        fake = SimpleNamespace(deadline=time.monotonic() + 60)
        async with aclosing(engine_stream()) as outs:
            while await Generation._next(fake, outs) is not None:  # type: ignore[arg-type]
                events.append("token")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await asyncio.sleep(0.1)
            tg.cancel_scope.cancel()  # the client went away

    asyncio.run(main())  # with wait_for in _next: RuntimeError "asynchronous generator is already running"
    assert events == ["token", "aborted"]
