"""A node's DRAM tier: recently read shards kept in memory, bounded by bytes, LRU.

A read served from here costs a dictionary lookup instead of an open, a read, a close and a
checksum pass over the payload. Entries are the shard's stored bytes (``header ||
payload``), inserted only after they passed every check a disk read makes, so what the
cache serves is exactly what a disk read would have served. The owner (``ShardStore``)
keeps it coherent: every path that removes, replaces, expires or evicts a shard discards
its entry under the same lock. Not thread-safe by itself. Pure: no disk, no sockets.
"""

from __future__ import annotations

from collections import OrderedDict


class HotCache:
    """name -> bytes, least recently used first, at most ``capacity_bytes`` in total.
    An item larger than ``max_item_fraction`` of the capacity is not kept (it would flush
    everything else for one object)."""

    def __init__(self, capacity_bytes: int, max_item_fraction: float = 0.25) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity must be >= 0 bytes (0 turns it off), got {capacity_bytes}")
        if not 0.0 < max_item_fraction <= 1.0:
            raise ValueError(f"max_item_fraction must be in (0, 1], got {max_item_fraction}")
        self.capacity = capacity_bytes
        self.max_item = int(capacity_bytes * max_item_fraction)
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.used = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def get(self, name: str) -> bytes | None:
        raw = self._items.get(name)
        if raw is None:
            self.misses += 1
            return None
        self._items.move_to_end(name)
        self.hits += 1
        return raw

    def put(self, name: str, raw: bytes) -> bool:
        """Keep ``raw`` as the most recently used entry; False when it is too large to keep."""
        self.discard(name)
        if len(raw) > self.max_item or self.capacity == 0:
            return False
        while self.used + len(raw) > self.capacity:
            _, old = self._items.popitem(last=False)
            self.used -= len(old)
            self.evictions += 1
        self._items[name] = raw
        self.used += len(raw)
        return True

    def discard(self, name: str) -> None:
        raw = self._items.pop(name, None)
        if raw is not None:
            self.used -= len(raw)

    def clear(self) -> None:
        self._items.clear()
        self.used = 0
