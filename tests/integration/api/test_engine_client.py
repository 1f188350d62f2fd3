"""``InProcessEngineClient`` on the real engine, without HTTP: stop, abort and refusal paths."""

from __future__ import annotations

import asyncio

import pytest

from services.api.engine_client import EngineRequest, EngineRequestError, EngineUnavailable, StructuredSpec
from services.api.inprocess import InProcessEngineClient

pytestmark = pytest.mark.integration

NEVER_ENDS = StructuredSpec("regex", "[a-z ]{2000}")  # EOS is masked until 2000 characters


def test_closing_the_engine_ends_in_flight_requests_and_refuses_new_ones(tiny_model):
    async def scenario():
        client = InProcessEngineClient(tiny_model)
        await client.start()
        assert await client.ready()
        gen = client.generate(EngineRequest("long", (0, 5, 6, 7), 3000, structured=NEVER_ENDS))
        first = await anext(gen)
        assert first.token_ids and first.prompt_tokens == 4
        close = asyncio.create_task(client.close())
        with pytest.raises(EngineUnavailable):
            async for _ in gen:  # ends within the close, not after 3000 tokens
                pass
        await asyncio.wait_for(close, 30)
        assert not await client.ready()
        with pytest.raises(EngineUnavailable):
            await anext(client.generate(EngineRequest("late", (0, 5), 4)))

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_abort_and_refusals(tiny_model):
    async def scenario():
        client = InProcessEngineClient(tiny_model)
        await client.start()
        try:
            total = client.stats().total_blocks
            gen = client.generate(EngineRequest("a", (0, 5, 6, 7), 3000, structured=NEVER_ENDS))
            await anext(gen)
            await client.abort("a")
            await client.abort("a")  # idempotent
            await client.abort("unknown")
            for _ in range(500):
                s = client.stats()
                if s.running == 0 and s.aborted_total == 1:
                    break
                await asyncio.sleep(0.01)
            assert client.stats().running == 0 and client.stats().aborted_total == 1
            await gen.aclose()
            with pytest.raises(EngineRequestError):  # the scheduler cannot hold it
                await anext(client.generate(EngineRequest("big", (0,) * 10, total * 256)))
            with pytest.raises(EngineRequestError):  # the grammar compiler refuses it
                await anext(
                    client.generate(EngineRequest("g", (0, 5), 4, structured=StructuredSpec("regex", "[a-")))
                )
            outs = [o async for o in client.generate(EngineRequest("ok", (0, 5, 6), 3, seed=1))]
            assert outs[-1].finish_reason in ("length", "stop") and outs[-1].completion_tokens <= 3
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
