"""Keeping the clocks of shards a read did not ask for in step with those it did (pure).

A node refreshes a shard's LRU position and TTL when it serves it. Data-first reads ask
only the k data shards, so without help the parity shards of a hot object would age as if
it were never read: the first evicted under LRU pressure, and expired after the class TTL
while the data shards live on. The object would quietly lose its redundancy. So after a
data-first read the client touches the object's parity shards (``TouchShards``, off the
read's critical path), at most once per ``interval_s`` per object: TTLs are days and the
LRU needs no finer order than that.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstore.directory import BlockMeta


class ParityRefresher:
    def __init__(
        self,
        k: int,
        interval_s: float = 60.0,
        max_tracked: int = 1 << 17,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0 or max_tracked < 1:
            raise ValueError(f"interval_s must be >= 0 and max_tracked >= 1, got {interval_s}, {max_tracked}")
        self.k, self.interval_s, self.max_tracked = k, interval_s, max_tracked
        self._clock = clock
        self._lock = threading.Lock()
        self._last: OrderedDict[bytes, float] = OrderedDict()  # object id -> last refresh, oldest first

    def due(self, metas: Sequence[BlockMeta]) -> dict[str, list[tuple[bytes, int]]]:
        """Node id -> (object id, shard index) refs of the parity shards to touch now for
        the objects of ``metas``; each object is then counted as refreshed."""
        now = self._clock()
        out: dict[str, list[tuple[bytes, int]]] = {}
        with self._lock:
            for meta in {m.object_id: m for m in metas}.values():
                last = self._last.get(meta.object_id)
                if last is not None and now - last < self.interval_s:
                    continue
                self._last[meta.object_id] = now
                self._last.move_to_end(meta.object_id)
                for index in range(self.k, len(meta.nodes)):
                    out.setdefault(meta.nodes[index], []).append((meta.object_id, index))
            while len(self._last) > self.max_tracked:
                self._last.popitem(last=False)
        return out
