"""Two engines share sliding-window slots: A's ended turn is published in the SWA directory
(a real redis-server), B finds it, fetches it over gRPC from A's slot server, and continues
the conversation from it with no replay; the output equals a cold run.

Prompts stay under one 256-token block, so B needs no prefix blocks from A (the KV store's
part, tested in tests/integration/api/test_cross_engine_store.py): the slot and its partial
block are the whole state.
"""

from __future__ import annotations

import time

import pytest

from engine.core import EngineCore
from engine.engine_config import EngineConfig
from engine.kvconnector.swa_directory import RedisSlotDirectory
from engine.messages import SeqOutput
from engine.scheduler.hashing import ROOT_HASH
from tests.engine_steps import prompt, run_greedy

pytestmark = pytest.mark.integration


def _run(core: EngineCore, rid: str, tokens: list[int], n: int) -> tuple[list[int], SeqOutput]:
    return run_greedy(core, rid, tokens, n)


def _wait(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_b_continues_from_a_slot_it_fetched_from_a(checkpoint_factory, redis_url):
    model = str(checkpoint_factory("tiny"))
    cfg = dict(model=model, host_swa_bytes=64 << 20, swa_directory=redis_url, swa_lease_s=2.0)
    a, b = EngineCore(EngineConfig(**cfg)), EngineCore(EngineConfig(**cfg))
    directory = RedisSlotDirectory(redis_url)
    try:
        first = prompt(200, 1)
        _run(a, "turn-1", first, n=1)  # its slot stands at 200 tokens: the whole prompt
        _wait(lambda: directory.locate([ROOT_HASH]), "A's slot in the directory")
        (loc,) = directory.locate([ROOT_HASH])
        assert loc.holder == a.slot_sharing.holder and loc.tail == tuple(first)
        follow = first + prompt(40, 2)
        got, last = _run(b, "turn-2", follow, n=12)
        assert last.cached_tokens == 200  # the fetched slot and partial block: nothing replayed
        stats = b.stats().extra
        assert stats["swa_slot_fetched"] == 1 and stats["swa_slot_hits_host"] == 1
        assert stats["swa_slot_fetched_bytes"] > 0 and a.stats().extra["swa_slots_served"] == 1
        cold = EngineCore(EngineConfig(model=model, enable_prefix_caching=False))
        assert got == _run(cold, "cold", follow, n=12)[0]
        # B now holds the slot too (it published its copy); A leaving withdraws only A's
        a.close()
        assert {x.holder for x in directory.locate([ROOT_HASH])} == {b.slot_sharing.holder}
        b.close()
        assert directory.locate([ROOT_HASH]) == []  # both left cleanly: nothing stale remains
    finally:
        a.close()
        b.close()
        directory.close()


def test_a_peer_that_is_gone_costs_a_replay_not_an_answer(checkpoint_factory, redis_url):
    model = str(checkpoint_factory("tiny"))
    cfg = dict(model=model, host_swa_bytes=64 << 20, swa_directory=redis_url, swa_lease_s=30.0)
    b = EngineCore(EngineConfig(**cfg))
    directory = RedisSlotDirectory(redis_url)
    try:
        first = prompt(200, 3)
        directory.heartbeat("127.0.0.1:9", 30.0)  # a live lease, but nothing listens there
        directory.publish("127.0.0.1:9", ROOT_HASH, first)
        got, last = _run(b, "turn-2", first + prompt(20, 4), n=4)
        assert last.cached_tokens == 0 and len(got) == 4
        stats = b.stats().extra
        assert stats["swa_slot_fetches"] == 1 and stats["swa_slot_fetch_failures"] == 1
    finally:
        b.close()
        directory.close()
