"""Sliding-window slot ids (pure, no torch).

Every running sequence owns one SWA slot: its raw window of recent tokens plus the
compressor partial/overlap state, valid exactly at the sequence's computed length. The
state cannot be rewound, so a slot is only reusable by a later request whose prompt
starts with *exactly* the tokens the slot has seen.

When a sequence finishes or is preempted its slot is *retained* rather than freed,
indexed by where its state stands: the hash of its last full block (the anchor) plus the
tokens of the partial block after it, whose physical block the retained entry keeps a
reference to. A later request whose prompt extends that exact prefix (multi-turn chat,
a resumed preempted request) adopts slot and partial block and starts computing at the
slot's position, with no replay at all. Retained slots are reused LRU when fresh slots
run out, and dropped early when the block pool needs their partial blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduler.hashing import BlockHash


class OutOfSlots(RuntimeError):
    """Raised when every slot is owned by a running sequence."""


@dataclass(frozen=True)
class RetainedSlot:
    slot: int
    anchor: BlockHash  # hash of the last full block before ``num_tokens`` (ROOT_HASH if none)
    num_tokens: int  # the slot's state is valid at this position
    tail: tuple[int, ...]  # tokens after the anchor block, up to num_tokens
    partial_block: int | None  # physical block holding the tail's compressed rows


class SwaSlotManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0 first
        self._retained: OrderedDict[int, RetainedSlot] = OrderedDict()  # oldest first
        self._by_anchor: dict[BlockHash, dict[int, RetainedSlot]] = {}
        self.reused = 0  # adoptions of a retained slot

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._retained)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    @property
    def num_retained_partials(self) -> int:
        """Blocks that dropping every retained slot would give back to the block pool."""
        return sum(1 for e in self._retained.values() if e.partial_block is not None)

    def allocate(self) -> tuple[int, RetainedSlot | None]:
        """A slot for a new sequence; when none is free the oldest retained one is reused and
        returned as the second item (the caller releases its partial block)."""
        if self._free:
            return self._free.pop(), None
        evicted = self.evict_oldest()
        if evicted is None:
            raise OutOfSlots(f"all {self.num_slots} SWA slots are owned by running sequences")
        return evicted.slot, evicted

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def retain(self, entry: RetainedSlot) -> None:
        self._retained[entry.slot] = entry
        self._by_anchor.setdefault(entry.anchor, {})[entry.slot] = entry

    def evict_oldest(self) -> RetainedSlot | None:
        if not self._retained:
            return None
        slot = next(iter(self._retained))
        return self._remove(slot)

    def match(
        self, anchors: Sequence[BlockHash], tokens: Sequence[int], block_size: int, max_len: int
    ) -> RetainedSlot | None:
        """Longest retained state that ``tokens`` extends. ``anchors[k]`` is the hash that
        precedes block k (ROOT_HASH, then the cached chain); only those blocks are usable."""
        best: RetainedSlot | None = None
        for k in range(len(anchors) - 1, -1, -1):
            for entry in self._by_anchor.get(anchors[k], {}).values():
                start = k * block_size
                if entry.num_tokens > max_len or entry.num_tokens < start:
                    continue
                if tuple(tokens[start : entry.num_tokens]) != entry.tail:
                    continue
                if best is None or entry.num_tokens > best.num_tokens:
                    best = entry
            if best is not None:
                return best
        return None

    def take(self, entry: RetainedSlot) -> int:
        """Adopt a retained slot (and its partial block reference) for a new owner."""
        self._remove(entry.slot)
        self.reused += 1
        return entry.slot

    def _remove(self, slot: int) -> RetainedSlot:
        entry = self._retained.pop(slot)
        group = self._by_anchor[entry.anchor]
        del group[slot]
        if not group:
            del self._by_anchor[entry.anchor]
        return entry
