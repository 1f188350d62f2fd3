"""Packing shards into ShardPieces messages: bounded message size, lossless reassembly."""

from __future__ import annotations

import os

import pytest

from kvstore.pieces import PIECE_OVERHEAD, Packer, shard_pieces


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
