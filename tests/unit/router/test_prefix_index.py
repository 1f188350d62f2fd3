import hashlib

import pytest

from router.prefix_index import PrefixIndex, PrefixIndexConfig


def sha_chain(tokens_blocks):
    """Chained SHA-256 block ids as bytes, like the engine's."""
    parent, out = b"", []
    for blk in tokens_blocks:
        parent = hashlib.sha256(parent + repr(blk).encode()).digest()
        out.append(parent)
    return out


def test_match_gives_longest_prefix_per_engine():
    idx = PrefixIndex(PrefixIndexConfig(3))
    idx.apply_stored(0, [1, 2, 3, 4])
    idx.apply_stored(1, [1, 2])
    idx.apply_stored(2, [9])
    assert idx.match([1, 2, 3, 5]).tolist() == [3, 2, 0]
    assert idx.match([1, 2, 3, 4]).tolist() == [4, 2, 0]
    assert idx.match([7]).tolist() == [0, 0, 0]


def test_bytes_block_ids_are_deterministic_across_processes():
    blocks = sha_chain([[1, 2], [3, 4], [5, 6]])
    idx = PrefixIndex(PrefixIndexConfig(2))
    idx.apply_stored(1, blocks[:2])
    assert idx.match(sha_chain([[1, 2], [3, 4], [7, 7]])).tolist() == [0, 2]


def test_removed_events_and_clear_engine():
    idx = PrefixIndex(PrefixIndexConfig(2))
    idx.apply_stored(0, [1, 2, 3])
    idx.apply_stored(1, [1, 2, 3])
    idx.apply_removed(0, [2, 99])  # unknown ids are ignored
    assert idx.match([1, 2, 3]).tolist() == [1, 3]
    idx.clear_engine(1)
    assert idx.match([1, 2, 3]).tolist() == [1, 0]
    assert len(idx) == 2  # blocks 1 and 3 still on engine 0


def test_capacity_evicts_least_recent_chain_leaf_first():
    idx = PrefixIndex(PrefixIndexConfig(1, capacity_blocks=4))
    idx.apply_stored(0, [1, 2, 3])  # one chain
    idx.apply_stored(0, [9])  # another, more recent
    # over capacity: the old chain loses its leaf, never its root, so a prefix survives
    assert idx.apply_stored(0, [7]) == [3]
    assert idx.match([1, 2, 3]).tolist() == [2]
    assert idx.apply_stored(0, [8]) == [2]
    assert idx.match([1, 2, 3]).tolist() == [1]
    assert idx.engine_blocks(0) == 4


def test_store_directory_match():
    idx = PrefixIndex(PrefixIndexConfig(1))
    idx.store_add([1, 2, 3])
    idx.store_remove([3])
    assert idx.store_match([1, 2, 3]) == 2


def test_validation():
    with pytest.raises(ValueError, match="num_engines"):
        PrefixIndexConfig(0)
    with pytest.raises(ValueError, match="out of range"):
        PrefixIndex(PrefixIndexConfig(2)).apply_stored(2, [1])


@pytest.mark.parametrize("capacity", [None, 40])
def test_index_agrees_with_a_plain_reference_under_random_events(capacity):
    """match/engine_blocks equal a set-per-engine model through random stores and removals."""
    import random

    rng = random.Random(7)
    n = 5
    idx = PrefixIndex(PrefixIndexConfig(n, capacity_blocks=capacity))
    held: list[set[int]] = [set() for _ in range(n)]
    for _ in range(400):
        e = rng.randrange(n)
        chain = [rng.randrange(30) for _ in range(rng.randrange(12))]
        if rng.random() < 0.7:
            evicted = idx.apply_stored(e, chain)
            held[e].update(chain)
            held[e].difference_update(evicted)
        else:
            idx.apply_removed(e, chain)
            held[e].difference_update(chain)
        if capacity is not None:
            assert len(held[e]) <= capacity
        query = [rng.randrange(30) for _ in range(rng.randrange(15))]
        want = []
        for s in held:
            k = 0
            while k < len(query) and query[k] in s:
                k += 1
            want.append(k)
        assert idx.match_list(query) == want
        assert [idx.engine_blocks(i) for i in range(n)] == [len(s) for s in held]
        assert len(idx) == len(set().union(*held))


def test_gc_tuning_is_undone_by_restore():
    import gc

    from router import gctune

    before = gc.get_threshold()
    previous = gctune.tune_for_latency(gctune.GcSettings(gen0=12_345))
    try:
        assert previous == before
        assert gc.get_threshold()[0] == 12_345
        assert gc.get_freeze_count() > 0
    finally:
        gctune.restore(previous)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="thresholds"):
        gctune.GcSettings(gen0=0)


def test_predictions_match_until_events_confirm_or_end_them():
    idx = PrefixIndex(PrefixIndexConfig(2))
    idx.apply_stored(0, [1, 2])
    idx.predict(1, [1, 2, 3, 4], now_s=0.0)
    assert idx.match([1, 2, 3, 4]).tolist() == [2, 4]  # union of held and predicted
    assert len(idx) == 2 and idx.predicted_blocks() == 4 and idx.engine_blocks(1) == 0
    idx.apply_stored(1, [1, 2, 3])  # the engine ran it: held now, prediction ended
    assert idx.predicted_blocks() == 1 and idx.engine_blocks(1) == 3
    idx.apply_removed(1, [4])  # a removal ends a prediction too
    assert idx.predicted_blocks() == 0
    assert idx.match([1, 2, 3, 4]).tolist() == [2, 3]
    idx.predict(0, [7, 8], known_held=1, now_s=0.0)  # the first block is not predicted again
    assert idx.match([7, 8]).tolist() == [0, 0] and idx.predicted_blocks() == 1
    idx.clear_engine(0)
    assert idx.predicted_blocks() == 0 and idx.match([1, 2]).tolist() == [0, 2]


def test_unconfirmed_predictions_expire_by_count_and_age():
    idx = PrefixIndex(PrefixIndexConfig(2, predicted_requests=2, predicted_ttl_s=10.0))
    idx.predict(0, [1], now_s=0.0)
    idx.predict(1, [2], now_s=1.0)
    idx.predict(0, [3], now_s=2.0)  # a third pending request: the oldest (block 1) expires
    assert idx.match([1]).tolist() == [0, 0] and idx.match([2]).tolist() == [0, 1]
    idx.predict(1, [4], now_s=11.5)  # block 2's prediction (t=1) is older than 10 s now
    assert idx.match([2]).tolist() == [0, 0]
    assert idx.match([3]).tolist() == [1, 0] and idx.match([4]).tolist() == [0, 1]
    with pytest.raises(ValueError, match="predicted_requests"):
        PrefixIndexConfig(2, predicted_requests=0)


def test_self_evicting_index_stores_predictions():
    idx = PrefixIndex(PrefixIndexConfig(1, capacity_blocks=2))
    idx.predict(0, [1, 2, 3])
    assert idx.engine_blocks(0) == 2 and idx.predicted_blocks() == 0
