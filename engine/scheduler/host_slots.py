"""A host-memory pool of sliding-window slots (pure: payload bytes, no torch): the window state of finished turns, kept past
the device's retained slots so that a later turn can continue from it without a replay.

Why in the engine (not the KV store): a slot is per-sequence state of one engine's model,
read back only by an engine of the same layout; it lives in the memory of the engine's own
process, next to the device, and is copied in with the same verified payloads a handoff uses.
The store keeps prefix blocks, which any engine may share; it never sees slots.

An entry is keyed like a retained device slot (``engine/scheduler/swa_slots.py``): the hash
of its last full block (the anchor) plus the tokens of the partial block after it. It holds
two payloads from the KV connector (``engine/kvconnector/caches.py``, checksummed): the slot
(``KIND_SLOT``) and, when the position is inside a block, that block's compressed rows
(``KIND_BLOCK``), so a hit that ends inside a block can use it. A request matches an entry
when its tokens extend the entry's exactly and the entry's full blocks are in the device's
prefix cache.

Bounded by bytes: least recently used entries go first. Thread-safe (the executor thread
saves, the scheduler thread matches).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.scheduler.hashing import BlockHash


@dataclass(frozen=True)
class HostSlot:
    anchor: BlockHash  # hash of the last full block before ``num_tokens`` (ROOT_HASH if none)
    num_tokens: int  # the slot's state is exact at this position
    tail: tuple[int, ...]  # tokens after the anchor block, up to num_tokens
    slot_payload: bytes
    tail_payload: bytes | None  # the partial block's compressed rows (None at a block boundary)

    @property
    def nbytes(self) -> int:
        return len(self.slot_payload) + len(self.tail_payload or b"")

    @property
    def key(self) -> tuple[BlockHash, tuple[int, ...]]:
        return self.anchor, self.tail


class HostSlotPool:
    def __init__(
        self,
        budget_bytes: int,
        fmt: str = "native",
        on_change: Callable[[str, HostSlot], None] | None = None,
        layers: int | None = None,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"the host slot pool needs a positive byte budget, got {budget_bytes}")
        if fmt not in ("native", "mxfp8"):
            raise ValueError(f"host slot format must be 'native' or 'mxfp8', got {fmt!r}")
        self.budget_bytes = budget_bytes
        # how slots are stored: "native" (the engine's dtype, exact) or "mxfp8" (about half of
        # bf16's bytes, lossy: only requests that accept approximate state use its entries)
        self.format = fmt
        # the first ``layers`` layers of a slot are kept (None: every layer). Fewer is lossy:
        # the others are rebuilt by a bounded replay on load (docs/engine-runtime.md)
        if layers is not None and layers < 1:
            raise ValueError(f"a host slot keeps at least 1 layer, got {layers}")
        self.layers = layers
        # ("put" | "drop", entry) after each change, outside the lock: the SWA directory's
        # publish and withdraw (engine/kvconnector/swa_directory.py)
        self.on_change = on_change
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[BlockHash, tuple[int, ...]], HostSlot] = OrderedDict()  # LRU first
        self._by_anchor: dict[BlockHash, set[tuple[int, ...]]] = {}
        self.nbytes = 0
        self.saved = self.evicted = self.refused = 0

    @property
    def lossy(self) -> bool:
        """Its slots are approximate state (MXFP8, or not every layer): only requests that
        accept approximate state use them."""
        return self.format != "native" or self.layers is not None

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[HostSlot]:
        """Every entry, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.values())

    def put(self, entry: HostSlot) -> bool:
        """Keep ``entry`` (replacing one of the same key), evicting the least recently used
        until it fits; False (nothing changed) when it alone exceeds the budget."""
        if entry.nbytes > self.budget_bytes:
            with self._lock:
                self.refused += 1
            return False
        with self._lock:
            self._drop(entry.key)
            dropped = []
            while self._entries and self.nbytes + entry.nbytes > self.budget_bytes:
                dropped.append(self._drop(next(iter(self._entries))))
                self.evicted += 1
            self._entries[entry.key] = entry
            self._by_anchor.setdefault(entry.anchor, set()).add(entry.tail)
            self.nbytes += entry.nbytes
            self.saved += 1
        if self.on_change is not None:
            for old in dropped:
                if old is not None:
                    self.on_change("drop", old)
            self.on_change("put", entry)
        return True

    def get(self, anchor: BlockHash, tail: Sequence[int]) -> HostSlot | None:
        """The entry of exactly this key (marked recently used), or None."""
        with self._lock:
            entry = self._entries.get((anchor, tuple(tail)))
            if entry is not None:
                self._entries.move_to_end(entry.key)
            return entry

    def match(
        self, anchors: Sequence[BlockHash], tokens: Sequence[int], block_size: int, max_tokens: int
    ) -> HostSlot | None:
        """The longest entry ``tokens`` extend, at most ``max_tokens`` long. ``anchors[k]`` is
        the hash that ends k full blocks of ``tokens`` (``anchors[0]`` = ROOT_HASH), for every
        k whose blocks the device caches. Marks the entry recently used."""
        best: HostSlot | None = None
        with self._lock:
            for k, anchor in enumerate(anchors):
                start = k * block_size
                for tail in self._by_anchor.get(anchor, ()):
                    n = start + len(tail)
                    if n > max_tokens or (best is not None and n <= best.num_tokens):
                        continue
                    if len(tail) < block_size and tuple(tokens[start:n]) == tail:
                        best = self._entries[(anchor, tail)]
            if best is not None:
                self._entries.move_to_end(best.key)
        return best

    def _drop(self, key: tuple[BlockHash, tuple[int, ...]]) -> HostSlot | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        tails = self._by_anchor[entry.anchor]
        tails.discard(entry.tail)
        if not tails:
            del self._by_anchor[entry.anchor]
        return entry
