"""``Feeds``: one engine's pushed state, fanned out to every router that follows it.

Each API process runs its own router, and each router follows every engine through the
engine actor's ``watch`` stream. The engine hands its prefix-cache events and its store
sightings over once (``take_cache_events`` / ``take_store_events`` empty what they return),
so the actor pumps them into ``Feeds``, which keeps one pending batch per subscriber.

A router that subscribes late (an API replica started after the engine, or one that lost
its stream) must not start from an empty view of the engine's cache: ``Feeds`` keeps a
mirror of the blocks the engine holds (the snapshot, then the events, as the consumer
applies them), and a new subscriber's first batch is a snapshot of that mirror.

Pure (no Ray, no torch): ``services/ray/actors.py`` owns one per engine actor.
"""

from __future__ import annotations

from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import BlockHash

# store sightings kept per subscriber until it reads them: hints, so a slow reader loses
# the oldest (its router only misses some store-affinity credit)
MAX_SEEN = 65_536


class Feeds:
    def __init__(self) -> None:
        self.mirror: set[BlockHash] = set()
        self._pending: dict[str, CacheEventBatch] = {}
        self._seen: dict[str, list[BlockHash]] = {}

    @property
    def subscribers(self) -> list[str]:
        return list(self._pending)

    def subscribe(self, name: str) -> None:
        """(Re)start ``name``'s feed: its next batch is a snapshot of the engine's cache."""
        self._pending[name] = CacheEventBatch(snapshot=tuple(self.mirror))
        self._seen[name] = []

    def unsubscribe(self, name: str) -> None:
        self._pending.pop(name, None)
        self._seen.pop(name, None)

    def pump(self, batch: CacheEventBatch, seen: list[BlockHash]) -> None:
        """What the engine handed over since the last pump, into the mirror and every feed."""
        if batch.snapshot is not None:
            self.mirror = set(batch.snapshot)
        for ev in batch.events:
            if ev.kind == "stored":
                self.mirror.update(ev.hashes)
            else:
                self.mirror.difference_update(ev.hashes)
        if batch:
            for name, held in self._pending.items():
                self._pending[name] = merge(held, batch)
        if seen:
            for held_seen in self._seen.values():
                held_seen.extend(seen)
                del held_seen[: max(0, len(held_seen) - MAX_SEEN)]

    def take(self, name: str) -> tuple[CacheEventBatch, list[BlockHash]]:
        """``name``'s pending cache events and store sightings (emptied)."""
        batch, seen = self._pending[name], self._seen[name]
        self._pending[name], self._seen[name] = CacheEventBatch(), []
        return batch, seen


def merge(held: CacheEventBatch, new: CacheEventBatch) -> CacheEventBatch:
    """``held`` then ``new``, as one batch (a snapshot in ``new`` supersedes what came before)."""
    if new.snapshot is not None:
        return CacheEventBatch(new.events, held.lost + new.lost, new.snapshot)
    return CacheEventBatch(held.events + new.events, held.lost + new.lost, held.snapshot)
