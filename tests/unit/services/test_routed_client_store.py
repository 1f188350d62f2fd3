"""The KV store in live routing: what replicas saw in the store reaches the router's index,
and the store fetch cost the ``sluice`` policy prices a store hit at is the replicas'
measurement (ignored until one is measured), never a hand-set constant."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import ExtraKeys, chain_hashes
from services.api.engine_client import EngineOutput, EngineRequest, EngineStats, ModelInfo
from services.routing.adapter import RouterAdapter, RouterAdapterConfig
from services.routing.client import ReplicaEngine, RoutedEngineClient, RoutingConfig

BLOCK = 256
EXTRA = ExtraKeys("fake-model")


def chain(n: int) -> list[bytes]:
    parent, out = b"", []
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


# -- the adapter ---------------------------------------------------------------------------
def test_a_measured_store_cost_decides_whether_a_store_hit_pulls_a_request_off_a_busy_engine():
    async def go() -> list[int]:
        r = RouterAdapter(RouterAdapterConfig("sluice", num_prefill=2, num_decode=1))
        blocks = chain(64)
        await r.on_cache_event(0, stored=blocks)  # engine 0 holds the prefix, but is busy
        await r.on_store_directory(added=blocks)  # and the store holds it too
        await r.on_engine_stats(
            "prefill", [{"engine": 0, "queued_work_s": 0.5}, {"engine": 1, "queued_work_s": 0.0}]
        )
        chosen = []
        # None: nothing measured, the store is ignored and engine 1 would recompute 64 blocks;
        # a fast store (0.1 ms/block) makes engine 1 cheaper; a slow one (50 ms) does not
        for cost in (None, 1e-4, 0.05):
            await r.set_store_fetch_cost(cost)
            assert r.config.store_fetch_s_per_block == cost
            assert r.prefill.config.store_fetch_s_per_block == cost  # type: ignore[attr-defined]
            view = r.request(f"q{cost}", 64 * BLOCK, blocks, arrival_s=0.0)
            score, _, _ = r.prefill.scores(np.array([0, 1]), view)  # type: ignore[attr-defined]
            chosen.append(int(np.argmin(score)))
        return chosen

    assert asyncio.run(go()) == [0, 1, 0]


def test_the_store_cost_setter_refuses_nonsense_and_other_policies_only_record_it():
    r = RouterAdapter(RouterAdapterConfig("round_robin", num_prefill=2))
    asyncio.run(r.set_store_fetch_cost(2e-4))
    assert r.config.store_fetch_s_per_block == 2e-4
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="store fetch cost must be >= 0"):
            asyncio.run(r.set_store_fetch_cost(bad))
    with pytest.raises(ValueError, match="store fetch cost must be >= 0"):
        RouterAdapterConfig("sluice", store_fetch_s_per_block=-1.0)


# -- the routed client, over fake replicas -------------------------------------------------
class FakeReplica:
    """A ``ReplicaEngine`` without a KV store: answers one token, caches nothing."""

    def __init__(self) -> None:
        self.extra: dict[str, float] = {}
        self.served: list[str] = []

    @property
    def alive(self) -> bool:
        return True

    def model_info(self) -> ModelInfo:
        return ModelInfo("fake-model", 1 << 16, 1000, (0,), "")

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self, timeout_s: float = 5.0) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 100, 100, 0, 0, 0, 0, dict(self.extra))

    def cache_identity(self) -> tuple[int, ExtraKeys]:
        return BLOCK, EXTRA

    def take_cache_events(self) -> CacheEventBatch:
        return CacheEventBatch()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.served.append(request.request_id)
        n = len(request.prompt_token_ids)
        yield EngineOutput(request.request_id, (1,), None, "length", n, 0, 1)


class StoreReplica(FakeReplica):
    """... with a KV store: reports the blocks it saw there and its measured fetch cost."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = {"kv_store_fetch_s_per_block": 0.0, "kv_store_saved_blocks": 0.0}
        self.pending: list[bytes] = []

    def take_store_events(self) -> list[bytes]:
        out, self.pending = self.pending, []
        return out


async def _ask(client: RoutedEngineClient, rid: str, prompt: list[int]) -> None:
    request = EngineRequest(rid, tuple(prompt), max_tokens=1)
    async for _ in client.generate(request):
        pass


def test_store_events_of_every_replica_reach_the_index_and_a_storeless_replica_is_fine():
    async def go() -> None:
        a, b, plain = StoreReplica(), StoreReplica(), FakeReplica()
        replicas: list[ReplicaEngine] = [a, b, plain]
        assert all(isinstance(r, ReplicaEngine) for r in replicas)
        client = RoutedEngineClient(replicas, "sluice")
        await client.start()
        prompt = list(range(8 * BLOCK + 5))
        blocks = chain_hashes(prompt, BLOCK, EXTRA)
        assert len(blocks) == 8
        a.pending = blocks[:5]  # replica 0 wrote the first 5 blocks
        b.pending = blocks[3:6]  # replica 1 fetched 3..5 (duplicates are one block)
        assert client.router.index.store_match(blocks) == 0
        await _ask(client, "tiny", [7] * 10)  # any request drains the replicas first
        assert client.router.index.store_match(blocks) == 6
        assert client.router.index.store_blocks() == 6
        assert client.store_events == [5, 3, 0]
        assert a.pending == b.pending == []  # drained, not re-read
        names = {m.name for m in client.metric_families()}
        assert {"sluice_router_store_blocks", "sluice_router_store_events"} <= names
        await client.close()

    asyncio.run(go())


def test_the_measured_fetch_cost_becomes_the_policys_and_stats_average_it():
    async def go() -> None:
        a, b, c = StoreReplica(), StoreReplica(), StoreReplica()
        client = RoutedEngineClient([a, b, c], "sluice")
        await client.start()
        policy = client.router.prefill
        await _ask(client, "r1", [1] * 10)
        # nothing measured: the store is ignored (an unmeasured cost cannot be compared)
        assert client.router.config.store_fetch_s_per_block is None
        assert policy.config.store_fetch_s_per_block is None  # type: ignore[attr-defined]
        assert client.stats().extra["kv_store_fetch_s_per_block"] == 0.0
        a.extra["kv_store_fetch_s_per_block"] = 0.002
        b.extra["kv_store_fetch_s_per_block"] = 0.004  # c has not fetched yet: not counted
        for r, saved in ((a, 10.0), (b, 20.0), (c, 5.0)):
            r.extra["kv_store_saved_blocks"] = saved
        await _ask(client, "r2", [2] * 10)
        assert client.router.config.store_fetch_s_per_block == pytest.approx(0.003)
        assert policy.config.store_fetch_s_per_block == pytest.approx(0.003)  # type: ignore[attr-defined]
        extra = client.stats().extra
        assert extra["kv_store_fetch_s_per_block"] == pytest.approx(0.003)  # a mean, not a sum
        assert extra["kv_store_saved_blocks"] == 35.0  # counters still sum
        # a measurement is kept when the replicas that made it stop reporting one
        a.extra["kv_store_fetch_s_per_block"] = b.extra["kv_store_fetch_s_per_block"] = 0.0
        await _ask(client, "r3", [3] * 10)
        assert client.router.config.store_fetch_s_per_block == pytest.approx(0.003)
        await client.close()

    asyncio.run(go())


def test_the_store_view_is_bounded_by_default_and_configurable():
    one = RoutedEngineClient([FakeReplica(), FakeReplica()], "sluice")
    assert one.router.index.config.store_capacity_blocks == 2 * 65_536
    small = RoutedEngineClient([FakeReplica()], "least_load", store_capacity_blocks=3)
    assert small.router.index.config.store_capacity_blocks == 3
    with pytest.raises(ValueError, match="store_capacity_blocks must be >= 1"):
        RoutingConfig(replicas=2, store_capacity_blocks=0)
