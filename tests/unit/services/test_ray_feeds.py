"""``Feeds``: an engine's cache events fanned out to every router, late subscribers included."""

from engine.scheduler.cache_events import CacheEvent, CacheEventBatch
from engine.scheduler.hashing import BlockHash
from services.ray.feeds import MAX_SEEN, Feeds


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def _view(batches: list[CacheEventBatch]) -> set:
    """What a router's index makes of a feed: the snapshot, then the events in order."""
    view: set = set()
    for b in batches:
        if b.snapshot is not None:
            view = set(b.snapshot)
        for ev in b.events:
            (view.update if ev.kind == "stored" else view.difference_update)(ev.hashes)
    return view


def test_each_subscriber_gets_every_event_once_and_a_late_one_starts_from_a_snapshot():
    f = Feeds()
    f.subscribe("api-0")
    f.pump(CacheEventBatch((CacheEvent("stored", (_h(1), _h(2), _h(3))),)), [_h(9)])
    first, seen = f.take("api-0")
    assert _view([first]) == {_h(1), _h(2), _h(3)} and seen == [_h(9)]
    assert f.take("api-0") == (CacheEventBatch(), [])  # taken once
    f.pump(CacheEventBatch((CacheEvent("removed", (_h(2),)),)), [])
    f.subscribe("api-1")  # late: its first batch is the engine's whole cache now
    late, late_seen = f.take("api-1")
    assert late.snapshot is not None and set(late.snapshot) == {_h(1), _h(3)} and late_seen == []
    f.pump(CacheEventBatch((CacheEvent("stored", (_h(4),)),)), [])
    a, _ = f.take("api-0")
    b, _ = f.take("api-1")
    assert _view([first, a]) == {_h(1), _h(3), _h(4)}  # the removal and the store, merged
    assert _view([late, b]) == {_h(1), _h(3), _h(4)}


def test_an_engine_snapshot_resets_the_mirror_and_supersedes_pending_events():
    f = Feeds()
    f.subscribe("a")
    f.pump(CacheEventBatch((CacheEvent("stored", (_h(1),)),)), [])
    f.pump(CacheEventBatch((CacheEvent("stored", (_h(7),)),), lost=3, snapshot=(_h(5),)), [])
    batch, _ = f.take("a")
    assert batch.snapshot == (_h(5),) and batch.lost == 3 and _view([batch]) == {_h(5), _h(7)}
    assert f.mirror == {_h(5), _h(7)}
    f.unsubscribe("a")
    assert f.subscribers == []


def test_store_sightings_are_bounded_per_subscriber():
    f = Feeds()
    f.subscribe("slow")
    for i in range(3):
        f.pump(CacheEventBatch(), [_h(j) for j in range(i * MAX_SEEN, (i + 1) * MAX_SEEN)])
    _, seen = f.take("slow")
    assert len(seen) == MAX_SEEN and seen[-1] == _h(3 * MAX_SEEN - 1)  # the newest kept
