"""A node's shard files: atomic writes, start-up rebuild that drops torn files, LRU and TTL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.codec import Codec, new_object_id
from kvstore.retention import RetentionConfig
from kvstore.shardfmt import HEADER_LEN, Shard
from kvstore.shardstore import CapacityExceeded, ShardCorrupt, ShardNotFound, ShardRejected, ShardStore
from tests.unit.kvstore.fakes import Clock


def _shards(size: int = 10_000, cls: int = 2) -> list[Shard]:
    return Codec().encode(new_object_id(), os.urandom(size), cls)


def test_put_get_and_files_are_complete(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 20)
    s = _shards()[4]
    assert store.put(s) == HEADER_LEN + len(s.payload)
    got = store.get(s.header.object_id, 4)
    assert got.to_bytes() == s.to_bytes()
    assert list((tmp_path / "tmp").iterdir()) == []
    with pytest.raises(ShardNotFound):
        store.get(s.header.object_id, 5)


def test_writer_rejects_short_long_and_wrong_payloads(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 20)
    s = _shards()[0]
    w = store.begin_put(s.header)
    w.write(s.payload[:-1])
    with pytest.raises(ShardRejected, match="payload bytes"):
        w.commit()
    w = store.begin_put(s.header)
    with pytest.raises(ShardRejected, match="exceeds"):
        w.write(bytes(s.payload) + b"x")
    w.abort()
    w = store.begin_put(s.header)
    w.write(bytes(len(s.payload)))
    with pytest.raises(ShardRejected, match="checksum"):
        w.commit()
    assert store.stats().shard_count == 0
    assert list((tmp_path / "tmp").iterdir()) == []


def test_rebuild_keeps_good_files_and_discards_torn_ones(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 22)
    shards = _shards(50_000)
    for s in shards:
        store.put(s)
    paths = [store.path_of(f"{s.header.object_id.hex()}.{s.index:02d}") for s in shards]
    raw = paths[0].read_bytes()
    paths[0].write_bytes(raw[: len(raw) // 2])  # torn by a crash
    paths[1].write_bytes(paths[1].read_bytes() + b"junk")  # extra bytes
    paths[2].write_bytes(b"\0" * 80)  # garbage header
    (tmp_path / "tmp" / "dead.part").write_bytes(b"half a write")
    again = ShardStore(tmp_path, 1 << 22)
    st = again.stats()
    assert st.discarded_at_start == 3 and st.shard_count == 9
    assert st.used_bytes == sum(HEADER_LEN + len(s.payload) for s in shards[3:])
    assert again.get(shards[5].header.object_id, 5).payload == shards[5].payload
    assert list((tmp_path / "tmp").iterdir()) == []


def test_bit_flip_on_disk_is_detected_and_dropped(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 1 << 20)
    s = _shards()[7]
    store.put(s)
    path = store.path_of(f"{s.header.object_id.hex()}.07")
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + 100] ^= 0x04
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardCorrupt):
        store.get(s.header.object_id, 7)
    assert not path.exists() and store.stats().corrupt_detected == 1


def test_lru_keeps_usage_under_capacity_and_hot_shards_survive(tmp_path: Path) -> None:
    clock = Clock()
    store = ShardStore(tmp_path, 200_000, RetentionConfig(high_watermark=0.9, low_watermark=0.6), clock=clock)
    hot = _shards(100_000)[0]  # ~10 KB payload
    store.put(hot)
    for _ in range(60):
        clock.t += 1
        store.put(_shards(100_000)[1])
        store.get(hot.header.object_id, 0)  # a read is an access
        assert store.stats().used_bytes <= 0.9 * 200_000
    assert store.stats().evicted > 0
    assert store.get(hot.header.object_id, 0).payload == hot.payload


def test_ttl_per_class(tmp_path: Path) -> None:
    clock = Clock()
    store = ShardStore(tmp_path, 1 << 20, RetentionConfig(ttl_s={"agent": 10, "chat": 100}), clock=clock)
    agent, chat = _shards(cls=1)[0], _shards(cls=2)[0]
    store.put(agent)
    store.put(chat)
    clock.t += 11
    with pytest.raises(ShardNotFound):
        store.get(agent.header.object_id, 0)
    assert store.get(chat.header.object_id, 0).payload == chat.payload
    clock.t += 200
    assert store.sweep() == (1, 0)
    assert store.stats().shard_count == 0 and store.stats().expired == 2


def test_oversized_shard_is_refused(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, 10_000)
    with pytest.raises(CapacityExceeded):
        store.put(_shards(200_000)[0])
