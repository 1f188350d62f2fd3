"""The router hashes a prompt with images exactly as the engines do: the image's key is in
the hash of every block its span overlaps, so the router's prefix index, fed by the engines'
cache events, matches an image request's blocks (and no other image's)."""

from __future__ import annotations

import asyncio
import io
from dataclasses import replace

import deepseek_recipe as dr
import numpy as np
import pytest
from PIL import Image

from engine.vision.stage import ImagePart
from services.api.engine_client import EngineRequest
from services.routing.client import RoutedEngineClient, RoutingConfig
from tests.engine_steps import prompt

pytestmark = pytest.mark.integration


def _part(seed: int, offset: int) -> ImagePart:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    info = dr.OpenCvImagePreprocessor().preprocess(buf.getvalue(), dr.PreprocessOptions("auto", 8192, 512))
    n = dr.MultiModalData([info]).image_token_adjustment() + 1
    return ImagePart(offset, n, bytes(info.data), info.width, info.height)


def test_the_router_matches_the_blocks_of_an_image_it_has_seen_and_not_another(checkpoint_factory):
    tiny_model = checkpoint_factory("tiny")

    async def go() -> tuple[int, int, int]:
        client = RoutedEngineClient.in_process(tiny_model, RoutingConfig(replicas=2, policy="sluice"))
        await client.start()
        try:
            a = _part(1, 300)
            ids = prompt(300, 7) + [7] * a.length + prompt(300, 8)
            req = EngineRequest("r1", tuple(ids), 2, temperature=0.0, images=(a,))
            async for _ in client.generate(req):
                pass
            await client._sync()
            full = len(ids) // 256
            same = await client._view(replace(req, request_id="r2"))
            other = await client._view(
                replace(req, request_id="r3", images=(replace(_part(2, 300), length=a.length),))
            )
            best = max(client.router.index.match_list(same.blocks))
            return full, best, max(client.router.index.match_list(other.blocks))
        finally:
            await client.close()

    full, same, other = asyncio.run(go())
    assert same == full  # every full block, the image's included
    assert other == 300 // 256  # only the block before the image
