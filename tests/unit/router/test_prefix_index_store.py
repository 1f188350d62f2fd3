"""The prefix index's view of the KV store: an LRU bounded by ``store_capacity_blocks``.

A live store drops blocks without telling the router, so the view is a hint kept to a
bound; the simulator's store publishes every drop and runs unbounded (``None``).
"""

from __future__ import annotations

import pytest

from router.prefix_index import PrefixIndex, PrefixIndexConfig


def _index(cap: int | None) -> PrefixIndex:
    return PrefixIndex(PrefixIndexConfig(2, store_capacity_blocks=cap))


def test_the_store_view_keeps_at_most_its_capacity_and_a_chain_loses_its_leaves_first():
    idx = _index(4)
    assert idx.store_add(["a0", "a1", "a2"]) == []
    assert idx.store_blocks() == 3 and idx.store_match(["a0", "a1", "a2"]) == 3
    # one more chain: the oldest chain's leaf goes first, so its root still matches
    assert idx.store_add(["b0", "b1"]) == ["a2"]
    assert idx.store_blocks() == 4
    assert idx.store_match(["a0", "a1", "a2"]) == 2
    assert idx.store_match(["b0", "b1"]) == 2
    # a chain longer than the capacity keeps its first blocks
    assert idx.store_add([f"c{i}" for i in range(6)]) == ["a1", "a0", "b1", "b0", "c5", "c4"]
    assert idx.store_match([f"c{i}" for i in range(6)]) == 4
    assert idx.store_match(["a0"]) == idx.store_match(["b0"]) == 0


def test_adding_a_known_block_refreshes_its_recency():
    idx = _index(3)
    for b in ("x", "y", "z"):
        idx.store_add([b])
    assert idx.store_add(["x"]) == []  # known: refreshed, not duplicated
    assert idx.store_blocks() == 3
    assert idx.store_add(["w"]) == ["y"]  # y is now the least recently added, not x
    assert idx.store_match(["x"]) == 1 and idx.store_match(["y"]) == 0
    assert idx.store_match(["z"]) == idx.store_match(["w"]) == 1


def test_store_match_stops_at_an_evicted_block_and_removals_are_applied():
    idx = _index(5)
    chain = ["r", "s", "t", "u"]
    idx.store_add(chain)
    idx.store_remove(["s", "never-added"])  # unknown blocks are ignored
    assert idx.store_match(chain) == 1 and idx.store_blocks() == 3
    idx.store_add(["p", "q"])  # full now: u t r q p, least recently added first
    assert idx.store_blocks() == 5
    assert idx.store_add(["s"]) == ["u"]
    assert idx.store_match(chain) == 3  # r s t; u was evicted
    # engine tiers are independent of the store view
    assert idx.match_list(chain) == [0, 0]


def test_unbounded_store_view_keeps_everything_until_removed():
    idx = _index(None)
    blocks = list(range(10_000))
    assert idx.store_add(blocks) == []
    assert idx.store_add(blocks[:10]) == []
    assert idx.store_blocks() == 10_000 and idx.store_match(blocks) == 10_000
    idx.store_remove(blocks[5000:5001])
    assert idx.store_match(blocks) == 5000


def test_a_store_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="store_capacity_blocks must be >= 1 or None"):
        PrefixIndexConfig(1, store_capacity_blocks=0)
