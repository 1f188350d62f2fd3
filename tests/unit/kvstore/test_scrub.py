"""A node's scrubber: shard files re-read and checked behind the hot cache, bad ones dropped,
at a bounded rate, stoppable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.codec import Codec, new_object_id
from kvstore.scrub import Scrubber
from kvstore.shardfmt import HEADER_LEN, Shard
from kvstore.shardstore import ShardNotFound, ShardStore, shard_name


class FakeTime:
    """A clock that only moves when the scrubber waits; records every wait."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.now, self.waits, self.stop_after = 0.0, [], stop_after

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return self.stop_after is not None and len(self.waits) >= self.stop_after


def _store(tmp_path: Path, count: int = 6) -> tuple[ShardStore, list[Shard]]:
    store = ShardStore(tmp_path, 1 << 26, cache_bytes=1 << 24)
    shards = [Codec().encode(new_object_id(), os.urandom(40_000))[i % 12] for i in range(count)]
    for s in shards:
        store.put(s)
    return store, shards


def _flip(store: ShardStore, shard: Shard) -> None:
    path = store.path_of(shard_name(shard.header.object_id, shard.index))
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + 7] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_pass_drops_rotted_shards_even_cached_ones_and_keeps_the_rest(tmp_path: Path) -> None:
    store, shards = _store(tmp_path)
    cached, cold = shards[0], shards[1]
    store.get(cached.header.object_id, cached.index)  # now served from the hot cache
    _flip(store, cached)
    _flip(store, cold)
    t = FakeTime()
    scrubber = Scrubber(store, 1 << 40, 60.0, t.wait, clock=t.clock)
    assert scrubber.run_pass()
    assert (scrubber.stats.passes, scrubber.stats.shards, scrubber.stats.corrupt) == (1, 6, 2)
    assert scrubber.stats.bytes == sum(HEADER_LEN + len(s.payload) for s in shards)
    for bad in (cached, cold):
        with pytest.raises(ShardNotFound):  # a reader finds it missing; the client repairs it
            store.get(bad.header.object_id, bad.index)
        assert not store.path_of(shard_name(bad.header.object_id, bad.index)).exists()
    for good in shards[2:]:
        assert store.get(good.header.object_id, good.index).to_bytes() == good.to_bytes()
    assert store.stats().corrupt_detected == 2
    assert scrubber.run_pass() and scrubber.stats.corrupt == 2  # nothing new the second time


def test_a_pass_stays_under_its_rate_and_stops_when_told(tmp_path: Path) -> None:
    store, shards = _store(tmp_path)
    total = sum(HEADER_LEN + len(s.payload) for s in shards)
    t = FakeTime()
    assert Scrubber(store, 10_000, 60.0, t.wait, clock=t.clock).run_pass()
    assert t.now == pytest.approx(total / 10_000)  # no faster than 10 kB/s
    t = FakeTime(stop_after=2)
    scrubber = Scrubber(store, 10_000, 60.0, t.wait, clock=t.clock)
    assert not scrubber.run_pass() and scrubber.stats.shards == 2 and scrubber.stats.passes == 0


def test_the_loop_waits_before_its_first_pass_and_between_passes(tmp_path: Path) -> None:
    store, _ = _store(tmp_path, count=2)
    t = FakeTime(stop_after=2)
    scrubber = Scrubber(store, 1 << 40, 60.0, t.wait, first_after_s=5.0, clock=t.clock)
    scrubber.loop()
    assert t.waits == [5.0, 60.0] and scrubber.stats.passes == 1


def test_a_shard_deleted_during_a_pass_is_skipped(tmp_path: Path) -> None:
    store, shards = _store(tmp_path, count=3)
    store.delete([(shards[1].header.object_id, shards[1].index)])
    assert store.scrub_one(shard_name(shards[1].header.object_id, shards[1].index)) is None
    assert store.scrub_one(shard_name(shards[0].header.object_id, shards[0].index)) == (
        HEADER_LEN + len(shards[0].payload),
        True,
    )


@pytest.mark.parametrize(("rate", "period", "first"), [(0, 1.0, 0.0), (1, 0.0, 0.0), (1, 1.0, -1.0)])
def test_bad_settings_are_refused(tmp_path: Path, rate: float, period: float, first: float) -> None:
    store, _ = _store(tmp_path, count=1)
    with pytest.raises(ValueError, match="scrub"):
        Scrubber(store, rate, period, lambda s: True, first_after_s=first)
