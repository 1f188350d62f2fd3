"""``InProcessEngineClient``'s disaggregation calls on the real engine, without Ray or HTTP.

``prefill`` on one client then ``resume`` on another gives the tokens ``generate`` gives on
one (greedy and seeded, a chunked prompt, several requests at once); reservations are
honoured and freed; refusals leave nothing held.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.kvconnector.transfer import EngineFull
from services.api.engine_client import EngineOutput, EngineRequest, EngineRequestError
from services.api.handoff import Handoff
from services.api.inprocess import InProcessEngineClient

pytestmark = pytest.mark.integration

KW = {"enable_prefix_caching": False, "max_num_batched_tokens": 64, "num_blocks": 32}

REQUESTS = (
    EngineRequest("greedy", (0, *range(5, 40)), 12, temperature=0.0),
    EngineRequest("seeded", (0, 7, 8, 9, 10), 10, temperature=0.9, seed=1234),
    EngineRequest("chunked", (0, *[(7 * i) % 200 + 3 for i in range(300)]), 8, temperature=0.0),  # 5 chunks
    EngineRequest("one", (0, 11, 12), 1, temperature=0.0),  # ends on the prefill engine
)


async def _tokens(stream) -> tuple[list[int], list[EngineOutput]]:
    outs = [o async for o in stream]
    return [t for o in outs for t in o.token_ids], outs


async def _split(prefill: InProcessEngineClient, decode: InProcessEngineClient, req: EngineRequest):
    first: list[EngineOutput] = []
    handoff = None
    async for item in prefill.prefill(req):
        if isinstance(item, Handoff):
            handoff = item
        else:
            first.append(item)
    if handoff is None:
        return [t for o in first for t in o.token_ids], first, False
    assert handoff.request_id == req.request_id and isinstance(handoff.payload, bytes)
    rest, outs = await _tokens(decode.resume(req, handoff.payload))
    return [t for o in first for t in o.token_ids] + rest, first + outs, True


def _held(client: InProcessEngineClient) -> tuple[int, int]:
    s = client.stats()
    return s.running + s.waiting, s.total_blocks - s.free_blocks


def test_prefill_then_resume_equals_one_engine(tiny_model):
    async def scenario():
        one, pre, dec = (InProcessEngineClient(tiny_model, **KW) for _ in range(3))
        for c in (one, pre, dec):
            await c.start()
        try:
            expected = {r.request_id: (await _tokens(one.generate(r)))[0] for r in REQUESTS}
            results = await asyncio.gather(*(_split(pre, dec, r) for r in REQUESTS))  # all at once
            for req, (tokens, outs, handed) in zip(REQUESTS, results, strict=True):
                assert tokens == expected[req.request_id], req.request_id
                assert handed == (req.request_id != "one")
                last = outs[-1]
                assert last.finish_reason in ("length", "stop")
                assert last.completion_tokens == len(tokens) or last.finish_reason == "stop"
                assert last.prompt_tokens == len(req.prompt_token_ids)
            await asyncio.sleep(0.1)
            assert _held(pre) == (0, 0) and _held(dec) == (0, 0)
            assert pre.stats().extra["handoffs_out"] == 3
        finally:
            for c in (one, pre, dec):
                await c.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))


def test_reservations_refusals_and_bad_payloads(tiny_model):
    async def scenario():
        pre, dec = InProcessEngineClient(tiny_model, **KW), InProcessEngineClient(tiny_model, **KW)
        await pre.start()
        await dec.start()
        try:
            room = await dec.room()
            assert room["reserved_blocks"] == 0 and room["blocks"] > 0
            block = dec.cache_identity()[0]
            # a reservation larger than the engine is refused and holds nothing
            assert not await dec.reserve("huge", room["blocks"] * block + 1)
            assert (await dec.room())["reserved_blocks"] == 0
            # one that fits is held, then consumed by the resume
            req = REQUESTS[0]
            assert await dec.reserve(req.request_id, len(req.prompt_token_ids) + 1, req.max_tokens)
            assert (await dec.room())["reserved_blocks"] == 1 and dec.stats().extra["reserved"] == 1
            tokens, _, handed = await _split(pre, dec, req)
            assert handed and (await dec.room())["reserved_blocks"] == 0
            # release and abort free a reservation; both are idempotent
            assert await dec.reserve("r", 10, 10) and await dec.release("r") and not await dec.release("r")
            assert await dec.reserve("r2", 10, 10)
            await dec.abort("r2")
            assert (await dec.room())["reserved_blocks"] == 0
            # all the room promised to another request: an unreserved import is refused, nothing changes
            assert await dec.reserve("hog", (await dec.room())["blocks"] * block)
            first = [i async for i in pre.prefill(REQUESTS[1])]
            assert isinstance(first[-1], Handoff)
            with pytest.raises(EngineFull):
                await anext(dec.resume(REQUESTS[1], first[-1].payload))
            assert await dec.release("hog")
            # a damaged payload or one for another request is a clear refusal
            with pytest.raises(EngineRequestError, match="refused"):
                await anext(dec.resume(REQUESTS[1], b"not a payload"))
            with pytest.raises(EngineRequestError, match="is for 'seeded'"):
                await anext(dec.resume(REQUESTS[0], first[-1].payload))
            # the same payload still resumes where it belongs
            rest, _ = await _tokens(dec.resume(REQUESTS[1], first[-1].payload))
            assert len(rest) + sum(len(o.token_ids) for o in first[:-1]) <= REQUESTS[1].max_tokens
            await asyncio.sleep(0.1)
            assert _held(pre) == (0, 0) and _held(dec) == (0, 0)
        finally:
            await pre.close()
            await dec.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))


def test_abort_during_prefill_and_after_resume_frees_everything(tiny_model):
    async def scenario():
        pre, dec = InProcessEngineClient(tiny_model, **KW), InProcessEngineClient(tiny_model, **KW)
        await pre.start()
        await dec.start()
        try:
            long = EngineRequest("long", (0, *[(3 * i) % 200 + 3 for i in range(700)]), 50, temperature=0.0)
            gen = pre.prefill(long)
            task = asyncio.ensure_future(anext(gen))
            await asyncio.sleep(0.05)
            task.cancel()  # the client went away mid-prompt
            with pytest.raises(asyncio.CancelledError):
                await task
            await gen.aclose()
            items = [
                i async for i in pre.prefill(EngineRequest("x", long.prompt_token_ids, 50, temperature=0.0))
            ]
            stream = dec.resume(EngineRequest("x", long.prompt_token_ids, 50), items[-1].payload)
            await anext(stream)
            await stream.aclose()  # the consumer stops mid-decode
            for _ in range(200):
                if _held(pre) == (0, 0) and _held(dec) == (0, 0):
                    break
                await asyncio.sleep(0.02)
            assert _held(pre) == (0, 0) and _held(dec) == (0, 0)
        finally:
            await pre.close()
            await dec.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))


def test_an_abort_that_races_the_start_of_its_call_wins(tiny_model):
    """An abort that arrives after a call began but before its request reached the engine
    (a handoff still being fetched, the request still being prepared) stops it: the import
    never happens, and the reservation made for it is freed. An abort from before the call
    (an earlier, failed attempt of the same request) does not stop a new attempt."""

    async def scenario():
        pre, dec = InProcessEngineClient(tiny_model, **KW), InProcessEngineClient(tiny_model, **KW)
        await pre.start()
        await dec.start()
        try:
            req = EngineRequest("raced", (0, *range(5, 40)), 12, temperature=0.0)
            items = [i async for i in pre.prefill(req)]
            payload = items[-1].payload
            assert await dec.reserve("raced", len(req.prompt_token_ids) + 1, 11)
            prepare = dec._prepare

            def prepare_then_abort(request):  # the abort lands while the call prepares
                out = prepare(request)
                asyncio.run_coroutine_threadsafe(dec.abort(request.request_id), loop).result()
                return out

            loop = asyncio.get_running_loop()
            dec._prepare = prepare_then_abort
            assert [o async for o in dec.resume(req, payload)] == []
            dec._prepare = prepare
            for _ in range(200):
                if _held(dec) == (0, 0) and dec.stats().extra.get("reserved", 0.0) == 0.0:
                    break
                await asyncio.sleep(0.02)
            assert _held(dec) == (0, 0) and dec.stats().extra.get("reserved", 0.0) == 0.0
            # a later attempt of the same request (a recovery) runs
            tokens, outs = await _tokens(dec.resume(req, payload))
            assert len(tokens) == 11 and outs[-1].finish_reason == "length"
        finally:
            await pre.close()
            await dec.close()

    asyncio.run(asyncio.wait_for(scenario(), 300))
