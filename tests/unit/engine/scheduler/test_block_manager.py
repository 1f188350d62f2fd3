from __future__ import annotations

import pytest

from engine.scheduler.block_manager import BlockManager, OutOfBlocks
from engine.scheduler.hashing import chain_hashes
from engine.scheduler.swa_slots import OutOfSlots, RetainedSlot, SwaSlotManager


def test_shared_blocks_are_ref_counted_and_lru_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    seq = bm.allocate(3)
    for b, h in zip(seq, hashes):
        bm.register(b, h)
    hit = bm.lookup(hashes)
    assert hit == seq and bm.stats.hit_blocks == 3
    bm.acquire(hit[:2])  # a second sequence shares the first two
    bm.release(seq)  # the first finishes: its last block is idle-cached, two stay shared
    assert [bm.ref_count(b) for b in seq] == [1, 1, 0]
    assert bm.num_available == 2  # one free, one evictable
    new = bm.allocate(2)  # takes the free block, then evicts the idle cached one
    assert seq[2] in new and bm.stats.evictions == 1
    assert bm.lookup(hashes) == seq[:2]  # the chain now stops at the evicted block
    bm.check_invariants()
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)


def test_released_sequence_evicts_last_blocks_first():
    bm = BlockManager(num_blocks=3, block_size=1)
    hashes = chain_hashes([1, 2, 3], 1)
    seq = bm.allocate(3)
    for b, h in zip(seq, hashes):
        bm.register(b, h)
    bm.release(seq)
    bm.allocate(1)
    assert bm.lookup(hashes, count=False) == seq[:2]


def test_duplicate_hash_keeps_first_block_and_double_release_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=1)
    (h,) = chain_hashes([5], 1)
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)  # computed twice concurrently: b stays private
    bm.release([a, b])
    assert bm.lookup([h], count=False) == [a]
    assert not bm.is_cached(b)
    bm.check_invariants()
    with pytest.raises(ValueError, match="released more often"):
        bm.release([b])


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=2, block_size=1, enable_prefix_caching=False)
    (h,) = chain_hashes([5], 1)
    (a,) = bm.allocate(1)
    bm.register(a, h)
    assert bm.lookup([h]) == []


def test_swa_slots_retain_match_and_reuse_lru():
    sm = SwaSlotManager(2)
    s0, ev = sm.allocate()
    s1, _ = sm.allocate()
    assert ev is None and {s0, s1} == {0, 1}
    anchor = chain_hashes([1, 2], 2)[0]
    sm.retain(RetainedSlot(s0, anchor, 3, (7,), partial_block=9))
    sm.retain(RetainedSlot(s1, anchor, 4, (7, 8), partial_block=10))
    # Longest exact state wins; a diverging tail does not match.
    assert sm.match([b"\x00" * 32, anchor], [1, 2, 7, 8, 9], 2, max_len=4).slot == s1
    assert sm.match([b"\x00" * 32, anchor], [1, 2, 7, 6, 9], 2, max_len=4).slot == s0
    assert sm.match([b"\x00" * 32, anchor], [1, 2, 7, 8], 2, max_len=3).slot == s0
    slot, evicted = sm.allocate()  # no free slot: the oldest retained one is reused
    assert evicted is not None and slot == s0 and evicted.partial_block == 9
    sm2 = SwaSlotManager(1)
    sm2.allocate()
    with pytest.raises(OutOfSlots):
        sm2.allocate()
