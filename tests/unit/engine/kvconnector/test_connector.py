"""The connector's engine-side rules, against an in-memory stand-in for the store client.

The stand-in has the three calls the connector uses (``get_prefix_async``, ``put_blocks``,
``close``) and lets a test hold a fetch or a write open. The real store (12 node
processes, Redis, faults) is exercised in tests/integration/engine/test_store_connector.py;
here each rule is isolated: a waiting request never stalls the loop, its prefix stays
pinned while it waits, abort releases everything, a full save queue drops blocks and not
the step, and a slow, failing or corrupt fetch means recompute with exact output.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest

from engine.core import CoreRequest, EngineConfig, EngineCore
from engine.kvconnector.connector import ConnectorConfig
from engine.sampling.params import SamplingParams
from engine.scheduler.request import RequestStatus

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class MemStore:
    """Block payloads by hash; ``hold_gets`` / ``hold_puts`` keep calls open until released."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.hold_gets = threading.Event()
        self.hold_puts = threading.Event()
        self.hold_gets.set()
        self.hold_puts.set()
        self.fail_gets: Exception | None = None
        self.gets = 0

    def get_prefix_async(self, hashes: list[bytes]) -> Future:
        self.gets += 1
        fut: Future = Future()

        def answer() -> None:
            self.hold_gets.wait()
            if not fut.set_running_or_notify_cancel():
                return  # the connector gave up on it (deadline)
            if self.fail_gets is not None:
                fut.set_exception(self.fail_gets)
                return
            run = []
            for h in hashes:
                if h not in self.blocks:
                    break
                run.append(memoryview(self.blocks[h]))
            fut.set_result(run)

        threading.Thread(target=answer, daemon=True).start()
        return fut

    def put_blocks(self, hashes, payloads, traffic_class="chat"):
        self.hold_puts.wait()
        for h, p in zip(hashes, payloads):
            self.blocks.setdefault(h, bytes(p))
        return []

    def delete(self, hashes) -> int:
        return sum(self.blocks.pop(h, None) is not None for h in hashes)

    def close(self) -> None:
        self.hold_gets.set()
        self.hold_puts.set()


def run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    core.add(CoreRequest(rid, tuple(prompt), params))
    tokens: list[int] = []
    for _ in range(10_000):
        for out in core.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens, out.cached_tokens
    raise AssertionError(f"{rid} did not finish")


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    return str(checkpoint_factory("tiny"))


@pytest.fixture(scope="module")
def cold(tiny):
    core = EngineCore(EngineConfig(model=tiny))
    yield core
    core.close()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def writer(tiny: str, store: MemStore, prompt: list[int], **cfg) -> EngineCore:
    """An engine that computes ``prompt`` and writes its blocks through to ``store``."""
    a = EngineCore(EngineConfig(model=tiny), store_client=store, connector=ConnectorConfig(**cfg))
    run(a, "w", prompt)
    assert a.store is not None and a.store.flush(10.0)
    return a


def test_a_waiting_fetch_never_stalls_other_requests_and_then_hits(tiny, cold):
    store = MemStore()
    prompt = prompt_of(1, 1100)  # 4 full blocks
    writer(tiny, store, prompt).close()
    assert len(store.blocks) == 4
    b = EngineCore(EngineConfig(model=tiny), store_client=store)
    store.hold_gets.clear()
    b.add(CoreRequest("long", tuple(prompt), GREEDY))
    assert b.scheduler.requests["long"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    other, _ = run(b, "other", prompt_of(2, 40))  # finishes while "long" waits
    assert other == run(cold, "other-ref", prompt_of(2, 40))[0]
    assert b.scheduler.requests["long"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    store.hold_gets.set()
    tokens: list[int] = []
    cached = -1
    while cached < 0:
        for out in b.step():
            if out.request_id == "long":
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    cached = out.cached_tokens
    replay = b.runner.model_cfg.num_hidden_layers * (b.runner.model_cfg.sliding_window - 1)
    assert cached == 4 * 256 - replay
    assert tokens == run(cold, "long-ref", prompt)[0]
    assert b.stats().extra["kv_store_fetched_blocks"] == 4
    b.close()


def test_the_local_prefix_is_pinned_while_waiting_and_abort_releases_it(tiny):
    store = MemStore()
    prompt = prompt_of(3, 1100)
    writer(tiny, store, prompt).close()
    b = EngineCore(EngineConfig(model=tiny), store_client=store)
    run(b, "first", prompt[:600])  # 2 blocks cached locally
    blocks = b.scheduler.cache.blocks
    free_before = blocks.num_available
    store.hold_gets.clear()
    b.add(CoreRequest("w", tuple(prompt), GREEDY))
    req = b.scheduler.requests["w"]
    assert len(req.pinned_blocks) == 2
    assert all(blocks.ref_count(x) == 1 for x in req.pinned_blocks)  # off the LRU: not evictable
    assert blocks.num_available == free_before - 2
    assert b.abort("w")
    store.hold_gets.set()
    for _ in range(5):
        b.step()
    assert blocks.num_available == free_before
    blocks.check_invariants()
    b.close()


@pytest.mark.parametrize(
    "fault", ["deadline", "error", "corrupt"], ids=["no-answer", "store-error", "bit-flip"]
)
def test_a_failed_fetch_recomputes_with_exact_output(tiny, cold, fault):
    store = MemStore()
    prompt = prompt_of(4, 1100)
    writer(tiny, store, prompt).close()
    if fault == "corrupt":  # flip one bit in the body of the third block
        h = list(store.blocks)[2]
        raw = bytearray(store.blocks[h])
        raw[-100] ^= 0x10
        store.blocks[h] = bytes(raw)
    elif fault == "error":
        store.fail_gets = ConnectionError("redis is gone")
    else:
        store.hold_gets.clear()
    b = EngineCore(
        EngineConfig(model=tiny), store_client=store, connector=ConnectorConfig(fetch_deadline_s=0.2)
    )
    tokens, cached = run(b, "r", prompt)
    assert tokens == run(cold, f"ref-{fault}", prompt)[0]
    extra = b.stats().extra
    if fault == "corrupt":  # the two good blocks are used, the bad one and the rest recomputed
        assert extra["kv_store_corrupt_blocks"] == 1 and extra["kv_store_fetched_blocks"] == 2
        replay = b.runner.model_cfg.num_hidden_layers * (b.runner.model_cfg.sliding_window - 1)
        assert cached == 2 * 256 - replay
        # healed on read: the bad block was deleted, and B's write-through stored it again
        assert b.store is not None and b.store.flush(10.0)
        c = EngineCore(EngineConfig(model=tiny), store_client=store)
        assert run(c, "healed", prompt)[1] == 4 * 256 - replay
        c.close()
    else:
        assert extra["kv_store_fetch_failures"] == 1 and cached == 0
    store.close()
    b.close()


def test_a_full_save_queue_drops_blocks_never_the_step(tiny, cold):
    store = MemStore()
    store.hold_puts.clear()  # the store takes nothing: the queue fills
    one_block = len(next(iter(writer(tiny, MemStore(), prompt_of(5, 300)).store.client.blocks.values())))
    a = EngineCore(
        EngineConfig(model=tiny), store_client=store, connector=ConnectorConfig(save_queue_bytes=one_block)
    )
    prompt = prompt_of(6, 1300)  # 5 full blocks
    tokens, _ = run(a, "r", prompt)
    assert tokens == run(cold, "r-ref", prompt)[0]
    extra = a.stats().extra
    assert extra["kv_store_dropped_blocks"] >= 3  # one block queued (maybe one in the writer), rest dropped
    store.hold_puts.set()
    assert a.store is not None and a.store.flush(10.0)
    assert 1 <= len(store.blocks) <= 2
    a.close()


def test_written_blocks_are_deduplicated_by_hash(tiny):
    store = MemStore()
    prompt = prompt_of(7, 1100)
    a = writer(tiny, store, prompt)
    saved = a.stats().extra["kv_store_saved_blocks"]
    run(a, "again", prompt + [5, 6, 7])  # same blocks, now local hits: nothing new to save
    assert a.store is not None and a.store.flush(10.0)
    assert a.stats().extra["kv_store_saved_blocks"] == saved == 4
    a.close()
