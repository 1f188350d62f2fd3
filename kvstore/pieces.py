"""Packing shards into ``ShardPieces`` messages for the batched RPCs (both directions).

Small shards share a message (up to ~chunk bytes of payload), large ones are split into
chunk-sized pieces, so the per-message cost of gRPC is paid per chunk, not per shard.
"""

from __future__ import annotations

from collections.abc import Iterator

from sluice_proto import store_pb2

PIECE_OVERHEAD = 96  # bytes a piece costs beyond its data (header, framing), for packing


def shard_pieces(
    ref: int, header: bytes, payload: bytes | memoryview, chunk: int
) -> Iterator[store_pb2.ShardPiece]:
    """The pieces of one shard: the first carries the header; each carries <= chunk bytes."""
    if len(payload) <= chunk:  # protobuf takes bytes only (an encode's data shards are views)
        yield store_pb2.ShardPiece(ref=ref, header=header, data=bytes(payload))
        return
    view = memoryview(payload)
    yield store_pb2.ShardPiece(ref=ref, header=header, data=bytes(view[:chunk]))
    for start in range(chunk, len(payload), chunk):
        yield store_pb2.ShardPiece(ref=ref, data=bytes(view[start : start + chunk]))


class Packer:
    """Accumulates pieces and hands out a message once ~chunk bytes are in it."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._pieces: list[store_pb2.ShardPiece] = []
        self._size = 0

    def add(self, piece: store_pb2.ShardPiece) -> store_pb2.ShardPieces | None:
        """Queue ``piece``; returns the message that had to be closed to make room, if any.
        A message never holds more than ``chunk`` bytes of data plus piece overheads."""
        size = len(piece.data) + PIECE_OVERHEAD
        out = self.flush() if self._pieces and self._size + size > self.chunk else None
        self._pieces.append(piece)
        self._size += size
        return out

    def flush(self) -> store_pb2.ShardPieces | None:
        if not self._pieces:
            return None
        msg = store_pb2.ShardPieces(pieces=self._pieces)
        self._pieces, self._size = [], 0
        return msg
