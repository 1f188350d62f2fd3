"""Behaviour every Directory backend must show (shared by the unit and Redis tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.directory import MAX_CHAIN, BlockMeta, Directory

NODES = tuple(f"n{i:02d}" for i in range(12))
TTL = {"agent": 1.0, "chat": 3.0}


def meta(i: int, cls: str = "chat", oid: bytes | None = None) -> BlockMeta:
    return BlockMeta(bytes([i]) * 32, oid or bytes([i]) * 16, NODES, 1000 + i, cls, 0xFFF, 5)


def check_directory_contract(d: Directory, advance: Callable[[float], None]) -> None:
    chain = [meta(i) for i in range(6)]
    for m in chain[:3] + chain[4:]:
        d.commit(m, TTL[m.traffic_class])
    keys = [m.key for m in chain]
    assert d.lookup_prefix(keys) == chain[:3]  # stops at the first gap
    assert d.lookup_prefix(keys[1:]) == chain[1:3]
    assert d.lookup_prefix([b"\xee" * 32, *keys]) == []
    assert d.get(keys[4]) == chain[4] and d.get(keys[3]) is None
    # A rewrite replaces the whole entry; set_present only applies to the named object.
    newer = meta(1, oid=b"\x77" * 16)
    d.commit(newer, TTL["chat"])
    assert not d.set_present(keys[1], chain[1].object_id, 0x3)
    assert d.set_present(keys[1], newer.object_id, 0x7FF)
    got = d.get(keys[1])
    assert got is not None and got.present == 0x7FF and got.object_id == newer.object_id
    assert got.missing() == [11]
    # TTL per class; touch refreshes it.
    agent = meta(20, cls="agent")
    d.commit(agent, TTL["agent"])
    advance(0.6)
    assert d.touch([agent.key, b"\xee" * 32], TTL) == 1
    advance(0.6)
    assert d.get(agent.key) is not None  # touched 0.6 s ago, TTL 1 s
    advance(1.1)
    assert d.get(agent.key) is None
    assert d.get(keys[0]) is not None  # chat, 3 s
    advance(1.0)
    assert d.get(keys[0]) is None
    d.commit(meta(30), TTL["chat"])
    assert d.delete([meta(30).key, b"\xee" * 32]) == 1 and d.get(meta(30).key) is None
    with pytest.raises(ValueError, match="exceeds the limit"):
        d.lookup_prefix([b"k"] * (MAX_CHAIN + 1))
    check_lookup_many(d)
    check_groups(d, advance)


def check_lookup_many(d: Directory) -> None:
    d.commit_many([(meta(40), TTL["chat"]), (meta(42), TTL["chat"])])
    d.commit_many([])
    assert d.lookup_many([meta(40).key, meta(41).key, meta(42).key]) == [meta(40), None, meta(42)]
    assert d.lookup_many([]) == []


def check_groups(d: Directory, advance: Callable[[float], None]) -> None:
    """Rows of a block group keep their span; an object is freed with its last row."""
    oid = b"\x55" * 16
    group = [
        BlockMeta(bytes([60 + i]) * 32, oid, NODES, 3000, "chat", 0xFFF, 5, offset=1000 * i, length=1000)
        for i in range(3)
    ]
    alone = meta(70)
    d.commit_many([(m, TTL["chat"]) for m in group] + [(alone, TTL["chat"])])
    keys = [m.key for m in group]
    assert d.lookup_prefix(keys) == group and d.lookup_many(keys) == group
    assert d.get(keys[2]) == group[2] and group[2].span() == (2000, 3000)
    assert alone.span() == (0, alone.size) and not alone.grouped  # a row without a span
    assert d.release([keys[1], b"\xee" * 32]) == (1, [])  # two rows still name the object
    assert d.lookup_prefix(keys) == group[:1] and d.get(keys[2]) == group[2]
    assert d.release([alone.key]) == (1, [alone])  # an ungrouped row frees its object at once
    advance(2.0)
    assert d.touch([keys[0], keys[2]], TTL) == 2  # refreshes the object's row count with its rows
    advance(1.5)  # past the first TTL: without the touch the count would be gone (and free all)
    assert d.release([keys[0]]) == (1, [])
    removed, freed = d.release([keys[2], keys[0]])
    assert removed == 1 and [(m.object_id, m.nodes) for m in freed] == [(oid, NODES)]
    assert d.release(keys) == (0, [])
