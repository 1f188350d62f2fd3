"""Physical block accounting for the paged compressed caches (pure, no torch).

One physical block holds the compressed-cache rows (CSA, indexer, HCA) of ``block_size``
consecutive token positions of one sequence. A full block whose content is known is
*registered* under its chained hash (``hashing.py``) and may then be shared by any
sequence with the same prefix: it is ref-counted, and when nothing references it any more
it stays in the prefix table on an LRU list until its memory is needed.

Invariants (checked by ``check_invariants`` in tests):
- every block is in exactly one of: referenced (ref > 0), ``_free`` (ref 0, no hash),
  ``_lru`` (ref 0, registered);
- ``_by_hash[h] == b`` implies ``_hash[b] == h``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.scheduler.cache_events import CacheEventBuffer
from engine.scheduler.hashing import BlockHash


class OutOfBlocks(RuntimeError):
    """Raised by ``allocate`` when fewer blocks are free or evictable than asked for."""


@dataclass
class PrefixCacheStats:
    queries: int = 0  # admissions that looked the prefix table up
    query_blocks: int = 0  # full prompt blocks looked up
    hit_blocks: int = 0  # of which found cached
    evictions: int = 0

    @property
    def miss_blocks(self) -> int:
        return self.query_blocks - self.hit_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


class BlockManager:
    """Ref-counted blocks, a free list, the prefix-hash table and an LRU of cached blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, event_capacity: int = 0
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        if event_capacity < 0:
            raise ValueError(f"event_capacity must be >= 0 (0 = no cache events), got {event_capacity}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_hash: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()
        # ``stored`` / ``removed`` per published / evicted hash, for a router (cache_events.py)
        self.events = CacheEventBuffer(event_capacity) if event_capacity and enable_prefix_caching else None

    # -- queries -------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free plus evictable cached)."""
        return len(self._free) + len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def cached_hashes(self) -> list[BlockHash]:
        """Every published hash (referenced or idle): what a router's index should hold."""
        return list(self._by_hash)

    def lookup(self, hashes: Sequence[BlockHash], count: bool = True) -> list[int]:
        """Blocks of the longest cached run of ``hashes`` from the start. Takes no reference."""
        found: list[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                found.append(b)
        if count:
            self.stats.queries += 1
            self.stats.query_blocks += len(hashes)
            self.stats.hit_blocks += len(found)
        return found

    # -- mutations -----------------------------------------------------------------------
    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one reference on each (cached) block, pulling it off the LRU if idle."""
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._lru:
                    raise ValueError(f"block {b} is neither referenced nor cached; cannot share it")
                del self._lru[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with one reference each; evicts LRU cached blocks if needed."""
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                h = self._hash[b]
                assert h is not None  # internal invariant: LRU blocks are registered
                del self._by_hash[h]
                self._hash[b] = None
                self.stats.evictions += 1
                if self.events is not None:
                    self.events.removed(h)
            self._ref[b] = 1
            out.append(b)
        return out

    def register(self, block: int, h: BlockHash) -> bool:
        """Publish a full, computed block under its hash; True if it was newly published. A
        hash already present keeps its first block (the duplicate stays private and returns
        to the free list when released)."""
        if not self.enable_prefix_caching or self._hash[block] is not None:
            return False
        if h in self._by_hash:
            return False
        self._hash[block] = h
        self._by_hash[h] = block
        if self.events is not None:
            self.events.stored(h)
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a sequence's blocks in order: they are
        released tail first, so a sequence's last blocks are evicted before its first."""
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} released more often than acquired")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def reset_prefix_cache(self) -> int:
        """Forget every idle cached block; returns how many were dropped."""
        n = len(self._lru)
        for b in list(self._lru):
            h = self._hash[b]
            if h is not None:
                del self._by_hash[h]
                if self.events is not None:
                    self.events.removed(h)
            self._hash[b] = None
            self._free.append(b)
        self._lru.clear()
        return n

    def check_invariants(self) -> None:
        free, lru = set(self._free), set(self._lru)
        for b in range(self.num_blocks):
            places = (self._ref[b] > 0) + (b in free) + (b in lru)
            if places != 1:
                raise AssertionError(f"block {b} is in {places} places (ref={self._ref[b]})")
            if b in free and self._hash[b] is not None:
                raise AssertionError(f"free block {b} still has a hash")
            if b in lru and self._hash[b] is None:
                raise AssertionError(f"LRU block {b} has no hash")
        for h, b in self._by_hash.items():
            if self._hash[b] != h:
                raise AssertionError(f"hash table points {h.hex()[:8]} at block {b} with another hash")
