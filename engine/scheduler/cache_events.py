"""Prefix-cache events for a router's global prefix index (pure: no torch, no I/O, no locks).

The block manager records ``stored`` when a full block is published under its chained hash
(``hashing.py``) and ``removed`` when a cached block is evicted or the prefix cache is
reset. A router replays them into its ``PrefixIndex`` so that it knows which engine holds
which prefix without asking.

Two bounded stages keep a slow (or absent) consumer from growing memory:

1. ``CacheEventBuffer``, owned by the engine's scheduler: one entry per block event,
   drop-oldest past ``capacity`` with a counter; the engine thread drains it every step.
2. ``CacheEventOutbox``, between the engine thread and the consumer (the caller guards it
   with a lock): it keeps appending drained events, and when anything was lost on the way
   (either stage overflowed) it replaces its content with a **snapshot** of every block
   the engine holds at that moment. The consumer then rebuilds its view from the snapshot
   and applies the events that follow; it is never left with a silently wrong index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.scheduler.hashing import BlockHash

EventKind = Literal["stored", "removed"]


@dataclass(frozen=True)
class CacheEvent:
    """Blocks that became cached (``stored``) or stopped being cached (``removed``), in order."""

    kind: EventKind
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class CacheEventBatch:
    """What one drain returns.

    ``snapshot`` (when not None) is every block the engine held at the time it was taken:
    the consumer replaces its whole view of this engine with it, then applies ``events``
    in order. ``lost`` counts block events dropped since the previous drain (informational
    once a snapshot covers them).
    """

    events: tuple[CacheEvent, ...] = ()
    lost: int = 0
    snapshot: tuple[BlockHash, ...] | None = None

    def __bool__(self) -> bool:
        return bool(self.events) or self.lost > 0 or self.snapshot is not None


class CacheEventBuffer:
    """Bounded FIFO of block events; past ``capacity`` the oldest entry is dropped and counted."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"CacheEventBuffer capacity must be >= 1 block event, got {capacity}")
        self.capacity = capacity
        self._entries: deque[tuple[EventKind, BlockHash]] = deque()
        self._lost = 0  # since the last drain
        self.dropped_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stored(self, h: BlockHash) -> None:
        self._push("stored", h)

    def removed(self, h: BlockHash) -> None:
        self._push("removed", h)

    def extend(self, events: Iterable[CacheEvent]) -> None:
        for ev in events:
            for h in ev.hashes:
                self._push(ev.kind, h)

    def clear(self) -> None:
        self._entries.clear()
        self._lost = 0

    def take_lost(self) -> int:
        """Entries dropped since the last drain or ``take_lost``; resets that count."""
        lost, self._lost = self._lost, 0
        return lost

    def drain(self) -> CacheEventBatch:
        """Everything buffered, consecutive events of one kind coalesced; empties the buffer."""
        events: list[CacheEvent] = []
        run: list[BlockHash] = []
        kind: EventKind | None = None
        for k, h in self._entries:
            if k != kind and run:
                assert kind is not None  # internal invariant: a run has a kind
                events.append(CacheEvent(kind, tuple(run)))
                run = []
            kind = k
            run.append(h)
        if run and kind is not None:
            events.append(CacheEvent(kind, tuple(run)))
        lost = self._lost
        self.clear()
        return CacheEventBatch(tuple(events), lost)

    def _push(self, kind: EventKind, h: BlockHash) -> None:
        if len(self._entries) >= self.capacity:
            self._entries.popleft()
            self._lost += 1
            self.dropped_total += 1
        self._entries.append((kind, h))


class CacheEventOutbox:
    """The hand-off between the engine thread and a consumer; see the module docstring.

    Not thread-safe by itself: the owner holds one lock around ``publish`` and ``take``
    (both are O(events) and never wait).
    """

    def __init__(self, capacity: int) -> None:
        self._buffer = CacheEventBuffer(capacity)
        self._snapshot: tuple[BlockHash, ...] | None = None
        self._lost = 0
        self.snapshots_total = 0

    @property
    def dropped_total(self) -> int:
        return self._buffer.dropped_total

    def publish(self, batch: CacheEventBatch, snapshot: Callable[[], Sequence[BlockHash]]) -> None:
        """Append a drained batch; if the batch or this outbox lost events, resnapshot.

        ``snapshot()`` must return every block the engine holds *now* (after the batch's
        events), so the pending events are subsumed by it and discarded.
        """
        self._buffer.extend(batch.events)
        lost = batch.lost + self._buffer.take_lost()
        if lost:
            self._lost += lost
            self._buffer.clear()
            self._snapshot = tuple(snapshot())
            self.snapshots_total += 1

    def take(self) -> CacheEventBatch:
        """Everything pending for the consumer (possibly an empty batch)."""
        batch = self._buffer.drain()
        out = CacheEventBatch(batch.events, self._lost, self._snapshot)
        self._snapshot, self._lost = None, 0
        return out
