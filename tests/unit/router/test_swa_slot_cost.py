"""The cost of a prefix hit includes what its SWA slot costs the engine: no replay on the
slot's holder, a fetch on another engine, the window replay when neither applies.

Arithmetic (tiny shape: 256-token blocks, 4 layers, 32-token window): a 1,040-token prompt
whose first 3 blocks are cached serves 768 - 4 * 31 = 644 tokens with an exact replay; a
directory slot at 1,000 tokens (3 blocks + a 232-token tail) serves 1,000 on its holder and
1,000 - fetch on any other engine whose cache holds the 3 blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from costmodel import CostModel
from engine.kvconnector.swa_directory import RedisSlotDirectory, SlotLocation
from engine.scheduler.cache_events import CacheEvent, CacheEventBatch
from engine.scheduler.hashing import ROOT_HASH, ExtraKeys, chain_hashes
from router import cache_aware, sluice  # noqa: F401  (registration)
from router.cache_aware import CacheAware
from router.policy import PolicyContext, RequestView, slot_fetch_tokens
from router.prefix_index import PrefixIndex, PrefixIndexConfig
from router.sluice import SluicePrefill
from services.api.engine_client import EngineOutput, EngineRequest, EngineStats, ModelInfo
from services.routing.client import RoutedEngineClient, SlotLookupConfig, usable_slot

BLOCK = 256
REPLAY = 4 * (32 - 1)  # exact replay of the tiny shape
N = 1040
SLOT = 1000  # 3 blocks + a 232-token tail
BLOCKS = [("b", k) for k in range(N // BLOCK)]


def view(**slot: Any) -> RequestView:
    return RequestView("r", N, BLOCKS, 0.0, 0, BLOCK, swa_replay_tokens=REPLAY, **slot)


def slotted(fetch: int = 20, holders: frozenset[int] = frozenset({1})) -> RequestView:
    return view(swa_slot_tokens=SLOT, swa_slot_blocks=3, swa_slot_holders=holders, swa_fetch_tokens=fetch)


# -- RequestView.cached_tokens -------------------------------------------------------------
def test_the_holder_saves_the_slot_position_with_no_replay():
    assert slotted().cached_tokens(3, engine=1) == SLOT
    # a longer hit whose replay leaves less than the slot: the slot still wins
    assert slotted().cached_tokens(4, engine=1) == SLOT  # 1,024 - 124 = 900 < 1,000


def test_another_engine_covering_the_anchor_saves_the_slot_less_its_fetch():
    assert slotted(fetch=20).cached_tokens(3, engine=0) == SLOT - 20
    # a fetch dearer than the replay it avoids: the engine's own hit less its replay
    assert slotted(fetch=900).cached_tokens(3, engine=0) == 3 * BLOCK - REPLAY


def test_a_slot_that_keeps_only_some_layers_still_pays_their_bounded_replay():
    partial = view(swa_slot_tokens=SLOT, swa_slot_blocks=3, swa_slot_holders=frozenset({1}), swa_fetch_tokens=20,
                   swa_slot_replay=31)  # fmt: skip
    assert partial.cached_tokens(3, engine=1) == SLOT - 31
    assert partial.cached_tokens(3, engine=0) == SLOT - 31 - 20


def test_an_engine_whose_hit_does_not_cover_the_anchor_pays_todays_replay():
    for engine in (0, 1):
        assert slotted().cached_tokens(2, engine=engine) == 2 * BLOCK - REPLAY
        assert slotted().cached_tokens(0, engine=engine) == 0


def test_never_more_than_the_hit_plus_the_slots_tail():
    # a slot anchored at the root (position 100, a 100-token tail): a holder with no block
    # cached saves 100 tokens, never the 1,000 of a farther slot it does not cover
    root = view(swa_slot_tokens=100, swa_slot_blocks=0, swa_slot_holders=frozenset({0}))
    assert root.cached_tokens(0, engine=0) == 100
    assert root.cached_tokens(3, engine=0) == 3 * BLOCK - REPLAY  # the longer hit wins
    # a holder whose hit ends inside the slot's tail block saves at most that hit + the tail
    huge = slotted(fetch=0, holders=frozenset({0, 1}))
    for m in range(3, 5):
        for e in (0, 1):
            assert huge.cached_tokens(m, e) <= min(m * BLOCK, N) + (SLOT - 3 * BLOCK)


def test_the_old_call_and_a_view_without_a_slot_mean_exactly_what_they_meant():
    plain, with_slot = view(), slotted()
    for m in range(6):
        hit = min(m * BLOCK, N)
        old = hit - min(REPLAY, hit)
        assert plain.cached_tokens(m) == with_slot.cached_tokens(m) == old
        assert plain.cached_tokens(m, engine=1) == old  # no slot: the engine changes nothing


def test_a_slot_beyond_the_prompts_last_token_or_outside_its_anchors_block_is_refused():
    with pytest.raises(ValueError, match="before the prompt's last token"):
        view(swa_slot_tokens=N, swa_slot_blocks=4)  # the last token is always computed
    with pytest.raises(ValueError, match="in the block after its anchor"):
        view(swa_slot_tokens=SLOT, swa_slot_blocks=2)  # a tail of a block and more
    with pytest.raises(ValueError, match="must be >= 0"):
        view(swa_fetch_tokens=-1)


# -- the fetch cost ------------------------------------------------------------------------
def test_the_fetch_cost_is_transfer_plus_a_round_trip_over_the_marginal_token_time():
    cost = CostModel(a=1e-9, b=1e-6, c=0.5, d=9e-6)  # the launch cost c is no per-token time
    # (1 MB / 1 GB/s + 1 ms) / (1e-9 * 10,000 + 1e-6 + 9e-6) = 2 ms / 20 us = 100 tokens
    assert slot_fetch_tokens(cost, 10_000, 1e6, 1e9, 1e-3) == 100
    assert slot_fetch_tokens(cost, 50, 1e6, 1e9, 1e-3) == 50  # never more than the position
    with pytest.raises(ValueError, match="bytes_per_s > 0"):
        slot_fetch_tokens(cost, 100, 1e6, 0.0, 1e-3)


def test_with_the_defaults_a_v4_flash_slot_fetch_is_below_a_bounded_replay():
    # V4-Flash: a 2.8 MB MXFP8 host slot (docs/data/bench_swa_h200.json), 43 layers, W = 128
    cfg, cost = SlotLookupConfig(), CostModel()
    for position in (4096, 16_384, 65_536):
        fetch = slot_fetch_tokens(cost, position, 2_779_392, cfg.bytes_per_s, cfg.round_trip_s)
        assert 0 < fetch < 127 < 43 * 127, (position, fetch)


# -- the routing decision ------------------------------------------------------------------
def _both_hold_three_blocks(n: int = 2) -> PolicyContext:
    index = PrefixIndex(PrefixIndexConfig(n))
    for e in range(n):
        index.apply_stored(e, BLOCKS[:3])
    return PolicyContext(n, index=index)


@pytest.mark.parametrize("holder", [0, 1])
def test_sluice_prefers_the_holder_when_loads_are_equal(holder):
    policy = SluicePrefill(_both_hold_three_blocks())
    assert policy.select([0, 1], slotted(holders=frozenset({holder}))) == holder


def test_sluice_costs_a_replica_without_the_slot_with_its_fetch_below_a_replay():
    ctx = _both_hold_three_blocks()
    cands = np.array([0, 1])
    _, pred, _ = SluicePrefill(ctx).scores(cands, slotted(fetch=20))
    _, plain, _ = SluicePrefill(ctx).scores(cands, view())
    assert pred[1] < pred[0] < plain[0] == plain[1]  # holder < fetch < replay
    assert pred[0] == pytest.approx(ctx.cost.prefill_time(N, SLOT - 20))
    assert plain[0] == pytest.approx(ctx.cost.prefill_time(N, 3 * BLOCK - REPLAY))


@pytest.mark.parametrize("holder", [0, 1])
def test_cache_aware_prefers_the_holder_among_equal_matches(holder):
    policy = CacheAware(PolicyContext(2))
    for e in (0, 1):
        policy.tree.apply_stored(e, BLOCKS[:3])
    assert policy.select([0, 1], slotted(holders=frozenset({holder}))) == holder


# -- finding the slot the prompt extends ---------------------------------------------------
def test_usable_slot_is_the_longest_the_prompt_extends_with_all_its_holders():
    prompt = list(range(N))
    hashes = [bytes([k]) * 32 for k in range(1, 4)]
    anchors = [ROOT_HASH, *hashes]
    tail = tuple(prompt[3 * BLOCK : SLOT])
    found = [
        SlotLocation(hashes[1], tuple(prompt[2 * BLOCK : 600]), "h:1"),  # shorter
        SlotLocation(hashes[2], tail, "h:2"),
        SlotLocation(hashes[2], tail, "h:3"),  # the same slot, held twice
        SlotLocation(hashes[2], (*tail[:-1], -1), "h:4"),  # another conversation
        SlotLocation(hashes[2], tuple(prompt[3 * BLOCK : N]), "h:5"),  # to the last token
        SlotLocation(b"x" * 32, (), "h:6"),  # not this prompt's anchor
    ]
    assert usable_slot(found, anchors, prompt, BLOCK) == (SLOT, 3, frozenset({"h:2", "h:3"}))
    assert usable_slot(found[:1], anchors, prompt, BLOCK) == (600, 2, frozenset({"h:1"}))
    assert usable_slot(found[3:], anchors, prompt, BLOCK) is None


# -- the routed client over fake replicas and a real directory ------------------------------
EXTRA = ExtraKeys("fake-model")


class SlotReplica:
    """A ``ReplicaEngine`` with slot sharing: its cache events and host pool are set by the test."""

    def __init__(self, holder: str, directory: str) -> None:
        self.holder, self.directory = holder, directory
        self.pending: tuple[bytes, ...] = ()
        self.extra = {"host_swa_slots": 2.0, "host_swa_bytes": 2e6}
        self.served: list[str] = []

    @property
    def alive(self) -> bool:
        return True

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            "fake-model", 1 << 16, 1000, (0,), "", (REPLAY, 31), "exact",
            swa_holder=self.holder, swa_directory=self.directory,
        )  # fmt: skip

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
        out, self.pending = self.pending, ()
        return CacheEventBatch(events=(CacheEvent("stored", out),) if out else ())

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.served.append(request.request_id)
        yield EngineOutput(request.request_id, (1,), None, "length", len(request.prompt_token_ids), 0, 1)


async def _ask(client: RoutedEngineClient, rid: str, prompt: list[int]) -> None:
    async for _ in client.generate(EngineRequest(rid, tuple(prompt), max_tokens=1)):
        pass


def test_the_routed_client_sends_the_request_to_the_slots_holder(redis_url):
    prompt = list(range(1, N + 1))
    hashes = chain_hashes(prompt, BLOCK, EXTRA)

    async def go() -> tuple[list[list[str]], int, int]:
        replicas = [SlotReplica("127.0.0.1:1", redis_url), SlotReplica("127.0.0.1:2", redis_url)]
        client = RoutedEngineClient(replicas, "sluice")
        await client.start()
        await _ask(client, "cold", [7] * 10)  # no block matched: no lookup
        assert client.swa_lookups == 0
        for r in replicas:
            r.pending = tuple(hashes[:3])
        d = RedisSlotDirectory(redis_url)
        d.heartbeat("127.0.0.1:2", 30.0)
        d.publish("127.0.0.1:2", hashes[2], prompt[3 * BLOCK : SLOT])
        d.close()
        await _ask(client, "warm", prompt)
        found = client.swa_slots_found
        await client.close()
        return [r.served for r in replicas], client.swa_lookups, found

    served, lookups, found = asyncio.run(go())
    assert served == [["cold"], ["warm"]], served  # without the slot the tie goes to replica 0
    assert (lookups, found) == (1, 1)


def test_a_directory_that_cannot_be_read_routes_as_without_it_and_is_counted():
    prompt = list(range(1, N + 1))
    hashes = chain_hashes(prompt, BLOCK, EXTRA)

    down = RedisSlotDirectory("redis://127.0.0.1:1/0")  # nothing listens on port 1

    async def go() -> tuple[list[list[str]], int, int]:
        replicas = [SlotReplica("127.0.0.1:1", "memory"), SlotReplica("127.0.0.1:2", "memory")]
        client = RoutedEngineClient(replicas, "sluice", slot_directory=down)
        await client.start()
        for r in replicas:
            r.pending = tuple(hashes[:3])
        await _ask(client, "warm", prompt)
        await client.close()
        down.close()
        return [r.served for r in replicas], client.swa_lookups, client.swa_lookup_failures

    served, lookups, failures = asyncio.run(go())
    assert served == [["warm"], []] and (lookups, failures) == (1, 1)
