"""Touching the parity shards that data-first reads skip: which refs, per node, how often."""

from __future__ import annotations

import pytest

from kvstore.directory import BlockMeta
from kvstore.refresh import ParityRefresher
from tests.unit.kvstore.fakes import Clock

NODES = tuple(f"n{i:02d}" for i in range(12))


def _meta(oid: bytes, rotate: int = 0, key: bytes = b"k") -> BlockMeta:
    nodes = NODES[rotate:] + NODES[:rotate]
    return BlockMeta(key, oid, nodes, 100, "chat", (1 << 12) - 1, 0)


def test_parity_refs_per_node_once_per_object_per_interval() -> None:
    clock = Clock(0.0)
    r = ParityRefresher(10, interval_s=60.0, clock=clock)
    a, b = b"a" * 16, b"b" * 16
    due = r.due([_meta(a), _meta(a, key=b"k2"), _meta(b, rotate=1)])  # a group's rows count once
    assert due == {"n10": [(a, 10)], "n11": [(a, 11), (b, 10)], "n00": [(b, 11)]}
    clock.t += 59.0
    assert r.due([_meta(a), _meta(b, rotate=1)]) == {}
    clock.t += 2.0
    assert r.due([_meta(a)]) == {"n10": [(a, 10)], "n11": [(a, 11)]}


def test_tracking_is_bounded() -> None:
    r = ParityRefresher(10, interval_s=1e9, max_tracked=2, clock=Clock(0.0))
    oids = [bytes([i]) * 16 for i in range(3)]
    for oid in oids:
        assert r.due([_meta(oid)])
    assert r.due([_meta(oids[0])])  # forgotten as the oldest of three: due again
    assert not r.due([_meta(oids[2])])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ParityRefresher(10, interval_s=-1.0)
