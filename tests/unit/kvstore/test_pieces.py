"""Packing shards into ShardPieces messages: bounded message size, lossless reassembly."""

from __future__ import annotations

import os

import pytest
from sluice_proto import store_pb2

from kvstore.pieces import (
    PIECE_OVERHEAD,
    Packer,
    WireError,
    WirePacker,
    get_shards_request,
    iter_pieces,
    shard_pieces,
    varint,
)


@pytest.mark.parametrize("sizes", [[10] * 50, [1000, 70_000, 5, 65_536, 65_537], [300_000]])
def test_messages_stay_under_chunk_and_reassemble(sizes: list[int]) -> None:
    chunk = 64 * 1024
    payloads = [os.urandom(n) for n in sizes]
    packer, messages = Packer(chunk), []
    for ref, payload in enumerate(payloads):
        for piece in shard_pieces(ref, b"h" * 64, payload, chunk):
            msg = packer.add(piece)
            if msg is not None:
                messages.append(msg)
    tail = packer.flush()
    if tail is not None:
        messages.append(tail)
    got: dict[int, bytes] = {}
    for msg in messages:
        assert sum(len(p.data) + PIECE_OVERHEAD for p in msg.pieces) <= chunk + PIECE_OVERHEAD
        assert len(msg.SerializeToString()) <= chunk + 64 * 1024
        for piece in msg.pieces:
            if piece.header:
                assert piece.ref not in got
                got[piece.ref] = b""
            got[piece.ref] += piece.data
    assert [got[i] for i in range(len(payloads))] == payloads
    if all(n < 1000 for n in sizes):
        assert len(messages) == 1  # many small shards share one message


# -- the hand-written wire encoding of ShardPieces ---------------------------------------------
def _wire_messages(shards: list[bytes | None], chunk: int) -> list[bytes]:
    packer = WirePacker(chunk)
    out: list[bytes] = []
    for ref, raw in enumerate(shards):
        if raw is None:
            packer.add_status(ref, store_pb2.SHARD_NOT_FOUND)
        else:
            packer.add_shard(ref, raw, 64)
        out += packer.take()
    return out + packer.take(final=True)


@pytest.mark.parametrize(
    "sizes", [[10] * 50, [1000, 70_000, 5, 65_536, 65_537, 0], [300_000], [200, 131_072]]
)
def test_wire_packer_output_is_shard_pieces_that_protobuf_parses(sizes: list[int]) -> None:
    chunk = 64 * 1024
    raws: list[bytes | None] = [os.urandom(64 + n) for n in sizes]
    raws.insert(1, None)
    messages = _wire_messages(raws, chunk)
    got: dict[int, bytes] = {}
    statuses: dict[int, int] = {}
    for wire in messages:
        assert len(wire) <= chunk + 64 * 1024  # within the gRPC message limit both sides set
        msg = store_pb2.ShardPieces.FromString(wire)  # the protobuf library agrees on every byte
        assert msg.SerializeToString() == wire
        assert sum(len(p.data) for p in msg.pieces) <= chunk
        for piece in msg.pieces:
            if piece.status != store_pb2.SHARD_OK:
                statuses[piece.ref] = piece.status
            elif piece.header:
                assert piece.ref not in got and len(piece.header) == 64
                got[piece.ref] = piece.header + piece.data
            else:
                got[piece.ref] += piece.data
    assert statuses == {1: store_pb2.SHARD_NOT_FOUND}
    assert [got.get(i) for i in range(len(raws))] == raws
    if all(n < 1000 for n in sizes):
        assert len(messages) == 1  # many small shards share one message


def test_iter_pieces_reads_what_protobuf_writes_including_unknown_fields_and_any_order() -> None:
    pieces = [
        store_pb2.ShardPiece(ref=0, header=b"h" * 64, data=b"payload-0"),
        store_pb2.ShardPiece(ref=1, status=store_pb2.SHARD_CORRUPT, detail="bad checksum ü"),
        store_pb2.ShardPiece(ref=300, header=b"H" * 64, data=os.urandom(70_000)),
        store_pb2.ShardPiece(ref=300, data=b"rest"),
    ]
    wire = store_pb2.ShardPieces(pieces=pieces).SerializeToString()
    got = list(iter_pieces(wire))
    assert [(p.ref, p.status, bytes(p.header), bytes(p.data), p.detail) for p in got] == [
        (p.ref, p.status, p.header, p.data, p.detail) for p in pieces
    ]
    # Fields in another order, plus fields this reader does not know (all wire types), are
    # read as protobuf reads them.
    body = (
        b"\x22\x03abc"  # data first
        + b"\x38\x96\x01"  # unknown varint field 7
        + b"\x41" + bytes(8)  # unknown fixed64 field 8
        + b"\x4a\x02zz"  # unknown bytes field 9
        + b"\x55" + bytes(4)  # unknown fixed32 field 10
        + b"\x08\x05"  # ref 5 last
    )  # fmt: skip
    wire = b"\x0a" + varint(len(body)) + body + b"\x12\x01x"  # and an unknown top-level field
    (piece,) = iter_pieces(wire)
    ref = store_pb2.ShardPieces.FromString(wire).pieces[0]
    assert (piece.ref, bytes(piece.data)) == (ref.ref, ref.data) == (5, b"abc")


@pytest.mark.parametrize(
    "wire",
    [b"\x0a\x05\x08\x01", b"\x0a\x03\x22\x09abc", b"\x0a\x02\x08\xff", b"\x0a" + b"\xff" * 11, b"\x0b"],
    ids=["piece-past-end", "field-past-end", "truncated-varint", "overlong-varint", "bad-wire-type"],
)
def test_malformed_messages_raise_wire_error(wire: bytes) -> None:
    with pytest.raises(WireError):
        list(iter_pieces(wire))


@pytest.mark.parametrize("n", [1, 127, 128, 300, 16_383, 16_384, 1 << 32, (1 << 64) - 1])
def test_varint_matches_protobuf(n: int) -> None:
    assert store_pb2.NodeStatsReply(used_bytes=n).SerializeToString() == b"\x10" + varint(n)
    wire = b"\x0a" + varint(len(varint(n)) + 1) + b"\x08" + varint(n)
    assert next(iter_pieces(wire)).ref == n


@pytest.mark.parametrize("chunk", [0, 1 << 20, 4 << 20])
def test_get_shards_request_is_what_protobuf_writes(chunk: int) -> None:
    refs = [(os.urandom(16), i) for i in (0, 1, 11, 200, 255)] + [(os.urandom(16), 0)] * 3
    want = store_pb2.GetShardsRequest(
        refs=[store_pb2.ShardRef(object_id=o, index=i) for o, i in refs], chunk_bytes=chunk
    ).SerializeToString()
    assert get_shards_request(refs, chunk) == want
    assert get_shards_request([], chunk) == store_pb2.GetShardsRequest(chunk_bytes=chunk).SerializeToString()
