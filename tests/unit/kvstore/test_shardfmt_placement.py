"""Shard header layout and checks; deterministic rendezvous placement."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.placement import NodeAddress, place
from kvstore.shardfmt import HEADER_LEN, Shard, ShardFormatError, ShardHeader, checksum, class_code


def _header(**kw: int | bytes) -> ShardHeader:
    base = dict(
        codec=1, k=10, m=2, index=3, traffic_class=1, object_id=b"o" * 16, object_len=10, payload_len=4
    )
    base.update(kw)
    return ShardHeader(payload_xxh3=checksum(b"abcd"), **base)  # type: ignore[arg-type]


def test_header_is_64_bytes_and_round_trips() -> None:
    h = _header()
    raw = h.pack()
    assert len(raw) == HEADER_LEN and raw[:4] == b"SLKV"
    assert ShardHeader.unpack(raw) == h
    assert Shard.parse(raw + b"abcd").payload == b"abcd"


@pytest.mark.parametrize("pos", [0, 4, 9, 11, 20, 35, 47, 55, 60])
def test_any_header_bit_flip_is_detected(pos: int) -> None:
    raw = bytearray(_header().pack())
    raw[pos] ^= 0x01
    with pytest.raises(ShardFormatError):
        ShardHeader.unpack(bytes(raw))


def test_payload_length_and_checksum_are_checked() -> None:
    raw = _header().pack()
    for bad in (b"abc", b"abcde", b"abce"):
        with pytest.raises(ShardFormatError):
            Shard.parse(raw + bad)
    with pytest.raises(ShardFormatError):
        ShardHeader.unpack(raw[:63])


def test_unknown_traffic_class_lists_known() -> None:
    assert class_code("agent") == 1 and class_code("chat") == 2
    with pytest.raises(ValueError, match="known: \\['agent', 'chat'\\]"):
        class_code("batch")


NODES = [f"n{i:02d}" for i in range(16)]


def test_placement_is_deterministic_across_processes() -> None:
    key = bytes(range(32))
    here = place(key, NODES, 12)
    code = f"from kvstore.placement import place; print(','.join(place(bytes(range(32)), {NODES!r}, 12)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout.strip()  # fmt: skip
    assert tuple(out.split(",")) == here
    assert len(set(here)) == 12
    assert place(key, list(reversed(NODES)), 12) == here


def test_placement_moves_little_when_a_node_leaves() -> None:
    keys = [os.urandom(32) for _ in range(300)]
    before = {k: set(place(k, NODES, 12)) for k in keys}
    after = {k: set(place(k, NODES[1:], 12)) for k in keys}
    for k in keys:
        if "n00" not in before[k]:
            assert after[k] == before[k]
        else:
            assert len(after[k] - before[k]) == 1
    spread = sum("n00" in g for g in before.values()) / len(keys)
    assert 0.6 < spread < 0.9  # ~12/16 of groups include any one node


def test_placement_and_address_validation() -> None:
    with pytest.raises(ValueError, match="needs 12 distinct nodes"):
        place(b"k", NODES[:11], 12)
    with pytest.raises(ValueError, match="host:port"):
        NodeAddress("n0", "localhost")
