"""Prefix-cache events: what the block manager publishes, and the bounded hand-off to a router."""

from __future__ import annotations

import pytest

from engine.scheduler.block_manager import BlockManager
from engine.scheduler.cache_events import CacheEvent, CacheEventBuffer, CacheEventOutbox
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.hashing import chain_hashes


def _replay(view: set[bytes], batch) -> set[bytes]:
    """What a consumer's index holds after applying ``batch`` (the contract of CacheEventBatch)."""
    if batch.snapshot is not None:
        view = set(batch.snapshot)
    for ev in batch.events:
        view = view | set(ev.hashes) if ev.kind == "stored" else view - set(ev.hashes)
    return view


def test_register_publishes_stored_and_eviction_publishes_removed():
    bm = BlockManager(num_blocks=3, block_size=2, event_capacity=64)
    hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    seq = bm.allocate(3)
    for b, h in zip(seq, hashes):
        bm.register(b, h)
    bm.register(seq[0], hashes[0])  # already published: no second event
    assert bm.events is not None
    assert bm.events.drain().events == (CacheEvent("stored", tuple(hashes)),)
    bm.release(seq)
    bm.allocate(2)  # evicts the two idle blocks, tail first
    batch = bm.events.drain()
    assert batch.events == (CacheEvent("removed", (hashes[2], hashes[1])),) and batch.lost == 0
    assert _replay(set(hashes), batch) == set(bm.cached_hashes()) == {hashes[0]}
    bm.check_invariants()


def test_a_duplicate_block_is_not_published_and_reset_removes_all_idle_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, event_capacity=64)
    (h,) = chain_hashes([7, 8], 2)
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)  # same content computed twice: b stays private
    assert [e.hashes for e in bm.events.drain().events] == [(h,)]
    bm.release([a, b])
    assert bm.reset_prefix_cache() == 1
    assert bm.events.drain().events == (CacheEvent("removed", (h,)),)


def test_events_are_off_by_default_and_without_prefix_caching():
    assert BlockManager(4, 2).events is None
    assert BlockManager(4, 2, enable_prefix_caching=False, event_capacity=8).events is None
    with pytest.raises(ValueError, match="event_capacity"):
        BlockManager(4, 2, event_capacity=-1)
    with pytest.raises(ValueError, match="cache_event_capacity"):
        SchedulerConfig(num_blocks=4, num_swa_slots=2, cache_event_capacity=-1)


def test_buffer_drops_oldest_past_capacity_and_counts():
    buf = CacheEventBuffer(capacity=3)
    hs = [bytes([i]) * 32 for i in range(5)]
    for h in hs:
        buf.stored(h)
    buf.removed(hs[4])
    batch = buf.drain()
    assert batch.lost == 3 and buf.dropped_total == 3 and len(buf) == 0
    assert batch.events == (CacheEvent("stored", (hs[3], hs[4])), CacheEvent("removed", (hs[4],)))
    assert buf.drain().lost == 0  # the count is per drain; the total stays
    with pytest.raises(ValueError, match="capacity"):
        CacheEventBuffer(0)


def test_outbox_resnapshots_when_the_consumer_falls_behind():
    """A slow consumer costs a snapshot, never memory, and its view is right afterwards."""
    bm = BlockManager(num_blocks=16, block_size=1, event_capacity=64)
    outbox = CacheEventOutbox(capacity=4)
    view: set[bytes] = set()
    hashes = chain_hashes(list(range(16)), 1)
    seq = bm.allocate(16)
    for i, (b, h) in enumerate(zip(seq, hashes)):
        bm.register(b, h)
        if i % 2:  # the engine thread hands over every other step; nobody takes for a while
            outbox.publish(bm.events.drain(), bm.cached_hashes)
    assert outbox.dropped_total > 0 and outbox.snapshots_total >= 1
    batch = outbox.take()
    assert batch.snapshot is not None and batch.lost > 0
    view = _replay(view, batch)
    assert view == set(hashes)
    bm.release(seq)
    bm.allocate(3)  # three evictions, well within capacity: plain events again
    outbox.publish(bm.events.drain(), bm.cached_hashes)
    batch = outbox.take()
    assert batch.snapshot is None and batch.lost == 0 and len(batch.events) == 1
    assert _replay(view, batch) == set(bm.cached_hashes())
    assert not outbox.take()  # nothing pending: an empty, falsy batch
