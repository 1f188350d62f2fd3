"""A node's hot cache: bounded by bytes, LRU, and coherent with the shard files it fronts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.codec import Codec, new_object_id
from kvstore.hotcache import HotCache
from kvstore.retention import RetentionConfig
from kvstore.shardfmt import HEADER_LEN, Shard
from kvstore.shardstore import ShardCorrupt, ShardNotFound, ShardStore, shard_name
from tests.unit.kvstore.fakes import Clock


def test_bounded_by_bytes_and_evicts_least_recently_used() -> None:
    cache = HotCache(1000, max_item_fraction=0.5)
    for name in "abcd":
        assert cache.put(name, bytes(300))
        assert cache.used <= 1000
    assert "a" not in cache and len(cache) == 3  # a was the least recently used
    assert cache.get("b") is not None  # b is now the most recently used
    cache.put("e", bytes(300))
    assert "c" not in cache and "b" in cache and cache.used == 900
    assert not cache.put("big", bytes(501))  # over half the capacity: not kept
    assert "big" not in cache and cache.used == 900
    cache.put("b", bytes(10))  # replacing an entry re-counts its bytes
    assert cache.used == 610
    cache.discard("b")
    cache.discard("nothing")
    assert cache.used == 600 and (cache.hits, cache.misses) == (1, 0)
    assert cache.get("b") is None and cache.misses == 1


def test_zero_capacity_keeps_nothing_and_bad_sizes_are_refused() -> None:
    cache = HotCache(0)
    assert not cache.put("a", b"x") and len(cache) == 0
    with pytest.raises(ValueError, match="0 turns it off"):
        HotCache(-1)
    with pytest.raises(ValueError, match="max_item_fraction"):
        HotCache(10, max_item_fraction=0)


def _shard(index: int = 3, size: int = 20_000, cls: int = 2) -> Shard:
    return Codec().encode(new_object_id(), os.urandom(size), cls)[index]


def _store(tmp_path: Path, **kw: object) -> ShardStore:
    return ShardStore(tmp_path, 1 << 22, cache_bytes=1 << 20, **kw)  # type: ignore[arg-type]


def test_cache_serves_byte_identical_shards_without_touching_the_file(tmp_path: Path) -> None:
    store = _store(tmp_path)
    s = _shard()
    store.put(s)
    oid = s.header.object_id
    assert store.cache.used == 0  # writes do not fill it: the first read checks the file
    assert store.get_raw(oid, 3) == s.to_bytes()
    assert store.cache.used == len(s.to_bytes()) and store.stats().cache_misses == 1
    store.path_of(shard_name(oid, 3)).write_bytes(b"not read any more")
    assert store.get_raw(oid, 3) == s.to_bytes()
    got = store.get(oid, 3)
    assert got.header == s.header and got.payload == s.payload
    assert store.stats().cache_hits == 2


def test_a_corrupt_file_is_detected_on_its_first_read_and_never_cached(tmp_path: Path) -> None:
    store = _store(tmp_path)
    s = _shard()
    store.put(s)
    path = store.path_of(shard_name(s.header.object_id, 3))
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + 7] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardCorrupt, match="checksum"):
        store.get_raw(s.header.object_id, 3)
    assert store.cache.used == 0 and store.stats().corrupt_detected == 1
    with pytest.raises(ShardNotFound):
        store.get_raw(s.header.object_id, 3)


@pytest.mark.parametrize("how", ["delete", "ttl", "sweep", "lru", "rewrite"])
def test_cache_entry_goes_with_its_shard(tmp_path: Path, how: str) -> None:
    clock = Clock()
    retention = RetentionConfig(ttl_s={"agent": 10, "chat": 100}, high_watermark=0.9, low_watermark=0.5)
    store = ShardStore(tmp_path, 200_000, retention, clock=clock, cache_bytes=1 << 20)
    s = _shard(cls=1)
    oid, name = s.header.object_id, shard_name(s.header.object_id, 3)
    store.put(s)
    store.get_raw(oid, 3)
    assert name in store.cache
    if how == "delete":
        assert store.delete([(oid, 3)]) == 1
    elif how == "ttl":
        clock.t += 11
    elif how == "sweep":
        clock.t += 11
        assert store.sweep() == (1, 0)
    elif how == "lru":
        for _ in range(5):  # other shards push it out (the clock stands still: no TTL here)
            store.put(_shard(size=400_000))
        assert store.stats().evicted >= 1 and store.stats().expired == 0
    else:  # repair writes the same shard again, from new bytes on disk
        store.put(s)
        path = store.path_of(name)
        raw = bytearray(path.read_bytes())
        raw[HEADER_LEN] ^= 0x01
        path.write_bytes(bytes(raw))
        with pytest.raises(ShardCorrupt):  # read from the file, not from the old entry
            store.get_raw(oid, 3)
    if how != "rewrite":
        with pytest.raises(ShardNotFound):
            store.get_raw(oid, 3)
    assert name not in store.cache and store.cache.used == 0


def test_cache_stays_within_its_bound_under_many_reads(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 24, cache_bytes=100_000)
    shards = [_shard(size=50_000) for _ in range(30)]
    for s in shards:
        store.put(s)
    for _ in range(2):
        for s in shards:
            assert store.get_raw(s.header.object_id, 3) == s.to_bytes()
            assert store.cache.used <= 100_000
    assert len(store.cache) == 100_000 // len(shards[0].to_bytes())
