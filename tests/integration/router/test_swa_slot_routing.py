"""The router costs a prefix hit with its SWA slot: two in-process replicas of the tiny
checkpoint share slots through a real Redis SWA directory, and the routed client sends a
conversation's next turn to the replica that holds its slot.

Both replicas cache the conversation's first 3 blocks (768 tokens), so without the
directory they tie (an exact replay of 4 * 31 tokens on either: 644 hit tokens) and the tie
goes to replica 0. Replica 1 ran the first turn (1,000 tokens, a slot at 1,000): its hit is
the whole 1,000 tokens with no replay, replica 0's the same less a fetch, so the turn goes
to replica 1 and is served 1,000 cached tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from costmodel import CostModel
from engine.kvconnector.swa_directory import RedisSlotDirectory
from engine.scheduler.hashing import chain_hashes
from services.api.engine_client import EngineOutput, EngineRequest
from services.routing.client import RoutedEngineClient, RoutingConfig

pytestmark = pytest.mark.integration

BLOCK = 256
FIRST = 1000


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


async def last(outputs: AsyncIterator[EngineOutput]) -> EngineOutput:
    outs = [out async for out in outputs]
    return outs[-1]


def test_the_next_turn_goes_to_the_replica_holding_its_slot(checkpoint_factory, redis_url, tmp_path):
    tiny = checkpoint_factory("tiny")
    cost = tmp_path / "cost.json"  # the tiny model's prefill on a CPU, roughly (test_live_routing)
    cost.write_text(CostModel(a=0.0, b=0.0, c=0.005, d=1e-3).to_json())
    first = tokens(1, FIRST)
    second = first + tokens(2, 40)

    async def go() -> None:
        cfg = RoutingConfig(replicas=2, policy="sluice", cost_model_path=Path(cost))
        engine = RoutedEngineClient.in_process(tiny, cfg, host_swa_bytes=64 << 20, swa_directory=redis_url)
        await engine.start()
        directory = RedisSlotDirectory(redis_url)
        try:
            holders = [r.model_info().swa_holder for r in engine.replicas]
            assert None not in holders and holders[0] != holders[1]
            assert {r.model_info().swa_directory for r in engine.replicas} == {redis_url}
            # straight to the replicas (no routing): replica 1 runs the first turn, replica 0
            # another prompt sharing its first 3 blocks
            await last(engine.replicas[1].generate(EngineRequest("turn1", tuple(first), 1)))
            await last(
                engine.replicas[0].generate(EngineRequest("other", tuple(first[:768] + tokens(3, 40)), 1))
            )
            block_size, extra = engine.replicas[0].cache_identity()
            anchor = chain_hashes(first, block_size, extra)[2]
            deadline = time.monotonic() + 30
            while {loc.holder for loc in directory.locate([anchor])} != set(holders):
                assert time.monotonic() < deadline, "the replicas' slots never reached the directory"
                await asyncio.sleep(0.05)

            before = list(engine.routed)
            out = await last(engine.generate(EngineRequest("turn2", tuple(second), 1)))
            assert [a - b for a, b in zip(engine.routed, before)] == [0, 1]
            assert out.cached_tokens == FIRST  # the slot, no replay
            assert (engine.swa_lookups, engine.swa_slots_found, engine.swa_lookup_failures) == (1, 1, 0)
        finally:
            directory.close()
            await engine.close()

    asyncio.run(go())
