"""``InProcessEngineClient`` on the real engine, without HTTP: stop, abort and refusal paths."""

from __future__ import annotations

import asyncio
import json

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


def test_request_timeout_ends_streams_in_band_and_plain_requests_with_504(tiny_model):
    import httpx

    from services.api.app import create_app
    from services.api.config import ApiConfig

    client = InProcessEngineClient(tiny_model)
    app = create_app(ApiConfig(request_timeout_s=1.0), client)
    body = {
        "model": "deepseek-chat", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000,
        "response_format": {"type": "regex", "regex": "[a-z ]{2000}"},
    }  # fmt: skip

    async def scenario():
        await client.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                plain = await c.post("/v1/chat/completions", json=body)
                streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
            for _ in range(500):
                if client.stats().running == 0:
                    break
                await asyncio.sleep(0.01)
            return plain, streamed, client.stats()
        finally:
            await client.close()

    plain, streamed, stats = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert plain.status_code == 504 and plain.json()["error"]["param"] == "request_timeout_s"
    events = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert streamed.status_code == 200 and len(events) > 2
    assert json.loads(events[-1])["error"]["param"] == "request_timeout_s"  # in-band, last event
    assert stats.running == 0 and stats.aborted_total == 2


def test_an_engine_behind_a_vision_pool_loads_no_encoder_and_takes_only_pool_rows(tiny_model):
    """``encode_images=False`` (a deployment with a vision pool): no encoder in the engine; rows
    a pool made from this checkpoint's encoder are served; a raw image is refused."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    from engine.model.vision import image_tokens
    from engine.vision.stage import EncodedImage, ImagePart, RowsFormat, VisionStage

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (42, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    n = image_tokens(84, 42)
    part = ImagePart(1, n, buf.getvalue(), 84, 42)
    stage = VisionStage.from_model_dir(tiny_model)
    fmt = RowsFormat.from_model_dir(tiny_model, torch.float32)
    assert stage is not None and fmt == stage.rows_format(torch.float32)
    (img,) = stage.encode([part])
    pooled = EncodedImage(1, n, img.key, fmt.pack(img.key, img.embeds))
    prompt = (0, *([5] * n), 6, 7)

    async def scenario():
        client = InProcessEngineClient(tiny_model, encode_images=False)
        await client.start()
        try:
            assert "vision_images_encoded" not in client.stats().extra  # no encoder, no counters
            out = await anext(client.generate(EngineRequest("pooled", prompt, 2, images=(pooled,))))
            assert out.token_ids
            with pytest.raises(EngineRequestError, match="encoded by its vision pool"):
                await anext(client.generate(EngineRequest("raw", prompt, 2, images=(part,))))
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_an_idle_engine_keeps_its_stats_snapshot_and_version(tiny_model):
    """``stats_version`` counts changes, so an idle engine's snapshot is the same object from
    one idle loop to the next: what pushes it on (the Ray actor's ``watch``) sends nothing,
    and ``changed`` sleeps through the idle loops but wakes every caller as soon as a request
    moves the stats."""

    async def scenario():
        client = InProcessEngineClient(tiny_model)
        await client.start()
        try:
            outs = [o async for o in client.generate(EngineRequest("a", (0, 5, 6), 3, seed=1))]
            assert outs[-1].finish_reason is not None
            for _ in range(500):  # the finished request leaves the counters
                if client.stats().running == 0 and client.stats().finished_total == 1:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # write-through counters settle
            idle = client.stats()
            await asyncio.sleep(0.5)  # tens of idle loops, each republishing
            assert client.stats() is idle
            seen = await client.changed(0, 0.0)  # what the last request's steps announced
            assert seen > 0 and await client.changed(seen, 0.5) == seen  # ten idle loops: none
            watchers = [asyncio.create_task(client.changed(seen, 30.0)) for _ in range(2)]
            [o async for o in client.generate(EngineRequest("b", (0, 5, 7), 3, seed=1))]
            # both woken by the request's steps (each watcher keeps its own count)
            assert all(w.done() and w.result() > seen for w in watchers)
            busy = client.stats()
            assert busy.extra["stats_version"] > idle.extra["stats_version"]
            assert busy.finished_total == 2 or busy.requests_total == 2
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
