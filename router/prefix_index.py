"""Global prefix index: which engines (and whether the KV store) hold which KV blocks.

Block ids are chained prefix hashes (the trace's ``hash_ids``; in live traffic the engine's
chained SHA-256 block hash as ``bytes`` or hex ``str``). Because each id already commits to
its whole prefix, the longest cached prefix of a request on an engine is the longest run of
its block ids, from the first, that the engine holds: a radix tree over blocks collapses to
a map ``block id -> holders``. Ids are only used as dict keys inside this process; nothing
derived from Python's ``hash()`` ever leaves it.

Holders are an ``int`` bitmask over engine indices ``0..num_engines-1``, so one walk over a
request's blocks yields the match length on every engine at once: O(prefix blocks +
engines) per lookup, independent of how many blocks are indexed.

Feeding: engines publish ``stored`` / ``removed`` events (``apply_stored`` /
``apply_removed``); the KV store's directory publishes ``store_add`` / ``store_remove``.
With ``capacity_blocks`` set, the index also evicts per engine in LRU order on its own
(an approximate index, for engines that do not publish removals). With
``store_capacity_blocks`` set, the store view is likewise an LRU of that many blocks
(a live store drops blocks by its own GC and TTLs without telling anyone, so the view is
a bounded hint there; the simulator's store publishes every drop and needs no bound).

Two tiers, as NVIDIA Dynamo's approximate indexer keeps predictions apart from events:

* **held**: what engines reported (events). Large (every cached block of the pool) and
  churned by evictions.
* **predicted**: what routing expects an engine to hold once it has run a request it was
  sent (``predict``), so a burst sharing a new prefix follows its first request before any
  event arrives. An engine's ``stored`` or ``removed`` event for a block ends its
  prediction; unconfirmed predictions expire (``predicted_requests``, ``predicted_ttl_s``),
  so an aborted request's blocks do not stay in the index. This tier holds only the blocks
  of requests in flight, so it stays small and cache resident: a routing decision's writes
  (up to a whole request of fresh blocks) never probe the large held tier.

``match`` sees the union of both tiers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import and_, not_, or_

import numpy as np


@dataclass(frozen=True)
class PrefixIndexConfig:
    num_engines: int
    capacity_blocks: int | None = None  # per engine; None: trust removal events only
    predicted_requests: int = 65_536  # unconfirmed routing predictions kept (oldest expire first)
    predicted_ttl_s: float = 600.0  # ... and for at most this long on the caller's clock
    # blocks the store view keeps (least recently added dropped first); None: trust
    # ``store_remove`` only (a directory that publishes every drop)
    store_capacity_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"PrefixIndexConfig.num_engines must be >= 1, got {self.num_engines}")
        if self.predicted_requests < 1 or self.predicted_ttl_s <= 0:
            raise ValueError(
                f"PrefixIndexConfig.predicted_requests must be >= 1 and predicted_ttl_s > 0, got "
                f"{self.predicted_requests} and {self.predicted_ttl_s}"
            )
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(
                f"PrefixIndexConfig.capacity_blocks must be >= 1 or None (no self-eviction), "
                f"got {self.capacity_blocks}"
            )
        if self.store_capacity_blocks is not None and self.store_capacity_blocks < 1:
            raise ValueError(
                f"PrefixIndexConfig.store_capacity_blocks must be >= 1 or None (no bound), "
                f"got {self.store_capacity_blocks}"
            )


class PrefixIndex:
    """Block -> holder-bitmask maps (held, predicted), per-engine counts and a store view.

    Per-block work on write paths runs inside C builtins (``map``, ``dict.update``): an
    event or a prediction covers up to a whole request's blocks.
    """

    def __init__(self, config: PrefixIndexConfig) -> None:
        self.config = config
        self._holders: dict[Hashable, int] = {}
        self._count = [0] * config.num_engines  # blocks held per engine
        # per engine, blocks in recency order; kept only when this index evicts by itself
        # (a plain dict keeps insertion order and is faster than an OrderedDict)
        self._lru: list[dict[Hashable, None]] | None = (
            None if config.capacity_blocks is None else [{} for _ in range(config.num_engines)]
        )
        self._predicted: dict[Hashable, int] = {}
        self._pending: deque[tuple[float, int, Sequence[Hashable]]] = deque()  # (at, engine, blocks)
        # blocks the KV store holds; with a bound, least recently added first (an OrderedDict:
        # O(1) refresh and eviction from the front, which a plain dict does not have)
        self._store: dict[Hashable, None] = {} if config.store_capacity_blocks is None else OrderedDict()

    # -- events -------------------------------------------------------------------------
    def apply_stored(self, engine: int, blocks: Sequence[Hashable], known_held: int = 0) -> list[Hashable]:
        """Record that ``engine`` holds ``blocks`` (refreshing their recency).

        ``known_held``: the caller knows the first ``known_held`` blocks are already held
        (from ``match``); they are skipped when this index does not evict by itself.
        Returns the blocks evicted from this engine's view to respect ``capacity_blocks``.
        Raises ValueError for an engine index out of range.
        """
        self._check(engine)
        if self._lru is not None and self.config.capacity_blocks is not None:
            return self._stored_with_lru(engine, blocks, self._lru[engine], self.config.capacity_blocks)
        tail = blocks[known_held:]
        if tail:
            bit, holders = 1 << engine, self._holders
            before = len(holders)
            # one probe per block: absent blocks are inserted holding ``bit`` right here,
            # present ones return their old mask (absent lookups in a large dict with
            # evictions are the costly part of a decision: each probe is a cache miss)
            olds = list(map(holders.setdefault, tail, repeat(bit)))
            lacking = list(map(not_, map(and_, olds, repeat(bit))))
            fixes = dict(zip(compress(tail, lacking), map(or_, compress(olds, lacking), repeat(bit))))
            holders.update(fixes)
            self._count[engine] += len(holders) - before + len(fixes)
            if self._predicted:
                self._unpredict(bit, tail)
        return []

    def _stored_with_lru(
        self, engine: int, blocks: Sequence[Hashable], lru: dict[Hashable, None], capacity: int
    ) -> list[Hashable]:
        bit, holders = 1 << engine, self._holders
        # tail first, so a chain loses its leaves before its root
        for b in reversed(blocks):
            if b in lru:
                del lru[b]
            else:
                holders[b] = holders.get(b, 0) | bit
            lru[b] = None
        evicted: list[Hashable] = []
        while len(lru) > capacity:
            b = next(iter(lru))
            del lru[b]
            self._drop(b, bit)
            evicted.append(b)
        self._count[engine] = len(lru)
        return evicted

    def apply_removed(self, engine: int, blocks: Iterable[Hashable]) -> None:
        """Record that ``engine`` evicted ``blocks``; unknown blocks are ignored."""
        self._check(engine)
        bit = 1 << engine
        lru = None if self._lru is None else self._lru[engine]
        holders = self._holders
        blocks = list(blocks)
        for b in blocks:
            if holders.get(b, 0) & bit:
                if lru is not None:
                    del lru[b]
                self._drop(b, bit)
                self._count[engine] -= 1
        if self._predicted:
            self._unpredict(bit, blocks)

    def clear_engine(self, engine: int) -> None:
        """Forget everything ``engine`` held or was predicted to hold (it restarted or left)."""
        self._check(engine)
        bit = 1 << engine
        self.apply_removed(engine, [b for b, h in self._holders.items() if h & bit])
        self._unpredict(bit, [b for b, h in self._predicted.items() if h & bit])

    def predict(
        self, engine: int, blocks: Sequence[Hashable], known_held: int = 0, now_s: float = 0.0
    ) -> None:
        """Routing sent a request with ``blocks`` to ``engine``: expect it to hold them.

        ``known_held`` leading blocks are skipped (``match`` found them). ``now_s`` is the
        caller's clock, for ``predicted_ttl_s``. An index that evicts by itself
        (``capacity_blocks``) has no events to confirm predictions: it stores them.
        """
        self._check(engine)
        if self._lru is not None:
            self.apply_stored(engine, blocks, known_held)
            return
        tail = blocks[known_held:]
        if tail:
            bit, predicted = 1 << engine, self._predicted
            olds = list(map(predicted.get, tail, repeat(0)))
            predicted.update(zip(tail, map(or_, olds, repeat(bit))))
            self._pending.append((now_s, engine, tail))
        self._expire(now_s)

    def _expire(self, now_s: float) -> None:
        pending, cfg = self._pending, self.config
        while pending and (
            len(pending) > cfg.predicted_requests or pending[0][0] < now_s - cfg.predicted_ttl_s
        ):
            _, engine, blocks = pending.popleft()
            self._unpredict(1 << engine, blocks)

    def _unpredict(self, bit: int, blocks: Iterable[Hashable]) -> None:
        """End ``bit``'s predictions on ``blocks`` (a later prediction of the same block for
        the same engine ends too: the two are not told apart)."""
        predicted = self._predicted
        for b in blocks:
            h = predicted.get(b, 0)
            if h & bit:
                if h == bit:
                    del predicted[b]
                else:
                    predicted[b] = h & ~bit

    def store_add(self, blocks: Iterable[Hashable]) -> list[Hashable]:
        """Record that the KV store holds ``blocks`` (refreshing the recency of known ones).

        With ``store_capacity_blocks``, the least recently added blocks beyond it are
        forgotten and returned (tail first, so a chain loses its leaves before its root).
        """
        store, cap = self._store, self.config.store_capacity_blocks
        if cap is None:  # nothing is ever evicted here, so recency is moot
            store.update(dict.fromkeys(blocks))
            return []
        assert isinstance(store, OrderedDict)  # internal invariant: built so when bounded
        # tail first, so the root ends most recent; a known block is popped and re-added, so
        # it moves to the most recent end (per-block work in C builtins)
        fresh = list(blocks)[::-1]
        deque(map(store.pop, fresh, repeat(None)), maxlen=0)
        store.update(dict.fromkeys(fresh))
        if len(store) <= cap:
            return []
        popitem = store.popitem
        return [popitem(False)[0] for _ in range(len(store) - cap)]

    def store_remove(self, blocks: Iterable[Hashable]) -> None:
        """Record that the KV store dropped ``blocks``; unknown blocks are ignored."""
        deque(map(self._store.pop, blocks, repeat(None)), maxlen=0)  # pop each, in C

    # -- queries ------------------------------------------------------------------------
    def match(self, blocks: Sequence[Hashable]) -> np.ndarray:
        """Matched prefix length in blocks for every engine, as int64 ``[num_engines]``."""
        return np.asarray(self.match_list(blocks), dtype=np.int64)

    def match_list(self, blocks: Sequence[Hashable]) -> list[int]:
        """``match`` as a plain list (the router's hot path avoids numpy per-call costs)."""
        n = self.config.num_engines
        out = [0] * n
        alive = (1 << n) - 1
        held, predicted = self._holders.get, self._predicted.get
        for i, b in enumerate(blocks):
            nxt = alive & held(b, 0)
            if nxt == alive:  # fast path: inside a run every live engine still holds it
                continue
            nxt = alive & (nxt | predicted(b, 0))
            if nxt == alive:
                continue
            dropped = alive ^ nxt
            while dropped:
                low = dropped & -dropped
                out[low.bit_length() - 1] = i
                dropped ^= low
            alive = nxt
            if not alive:
                return out
        while alive:
            low = alive & -alive
            out[low.bit_length() - 1] = len(blocks)
            alive ^= low
        return out

    def store_match(self, blocks: Sequence[Hashable]) -> int:
        """Length in blocks of the longest prefix of ``blocks`` the KV store holds."""
        n = 0
        for b in blocks:
            if b not in self._store:
                break
            n += 1
        return n

    def store_blocks(self) -> int:
        """Blocks the store view holds."""
        return len(self._store)

    def engine_blocks(self, engine: int) -> int:
        self._check(engine)
        return self._count[engine]

    def __len__(self) -> int:
        """Distinct blocks held by at least one engine (events; predictions not counted)."""
        return len(self._holders)

    def predicted_blocks(self) -> int:
        """Distinct blocks with an unconfirmed prediction."""
        return len(self._predicted)

    # -- internals ----------------------------------------------------------------------
    def _drop(self, block: Hashable, bit: int) -> None:
        h = self._holders.get(block, 0) & ~bit
        if h:
            self._holders[block] = h
        else:
            self._holders.pop(block, None)

    def _check(self, engine: int) -> None:
        if not 0 <= engine < self.config.num_engines:
            raise ValueError(f"engine index {engine} out of range 0..{self.config.num_engines - 1}")
