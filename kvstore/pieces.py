"""Packing shards into ``ShardPieces`` messages for the batched RPCs (both directions).

Small shards share a message (up to ~chunk bytes of payload), large ones are split into
chunk-sized pieces, so the per-message cost of gRPC is paid per chunk, not per shard.

Two ways to build the same message:

- ``Packer`` and ``shard_pieces`` build protobuf objects (``PutShards``, client side).
- ``WirePacker`` writes the protobuf wire encoding of ``ShardPieces`` directly, with one
  copy of the shard bytes (a ``b"".join``), and ``iter_pieces`` reads it back as
  ``memoryview`` slices of the received message, with no copy. ``GetShards`` uses these:
  the protobuf objects cost a copy of every byte on each of building, serializing and
  parsing, and that copying was the largest single cost of a read on both sides (measured
  with perf, docs/benchmarks.md). The bytes on the wire are plain ``ShardPieces``: any
  protobuf client can parse them, and the unit tests check both directions against the
  protobuf library.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from sluice_proto import store_pb2

PIECE_OVERHEAD = 96  # bytes a piece costs beyond its data (header, framing), for packing

# Field keys of ShardPieces / ShardPiece (field number << 3 | wire type).
_PIECES_KEY = 0x0A  # ShardPieces.pieces = 1, length-delimited
_REF_KEY = 0x08  # ShardPiece.ref = 1, varint
_STATUS_KEY = 0x10  # ShardPiece.status = 2, varint
_HEADER_KEY = 0x1A  # ShardPiece.header = 3, length-delimited
_DATA_KEY = 0x22  # ShardPiece.data = 4, length-delimited
_DETAIL_KEY = 0x2A  # ShardPiece.detail = 5, length-delimited


class WireError(ValueError):
    """A message is not a well-formed ``ShardPieces`` encoding."""


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


# -- the wire encoding, written and read by hand ----------------------------------------------
def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes([i]) for i in range(0x80)]


class WirePacker:
    """Builds ``ShardPieces`` messages as bytes, ~``chunk`` bytes of data each.

    ``add_shard`` takes a whole shard as stored (``header || payload``, one buffer) and
    frames it without copying; ``take`` returns the messages completed so far, each made
    by one ``b"".join``. A message holds at most ``chunk`` data bytes plus framing."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._parts: list[bytes | memoryview] = []
        self._size = 0
        self._done: list[bytes] = []

    def _piece(self, body: list[bytes | memoryview], body_len: int, data_len: int) -> None:
        if self._parts and self._size + data_len + PIECE_OVERHEAD > self.chunk:
            self._close()
        self._parts += (_PIECES_KEY_B, varint(body_len), *body)
        self._size += data_len + PIECE_OVERHEAD

    def _close(self) -> None:
        if self._parts:
            self._done.append(b"".join(self._parts))
            self._parts, self._size = [], 0

    def add_shard(self, ref: int, raw: bytes, header_len: int) -> None:
        """Shard ``ref`` (position in the request) from its stored bytes, split as needed.
        Fields at their default (ref 0, empty data) are left out, as protobuf does."""
        view = memoryview(raw)
        first = min(len(raw) - header_len, self.chunk)
        ref_f = _ref_field(ref)
        body = [*ref_f, _HEADER_KEY_B, varint(header_len), view[:header_len]]
        if first:
            body += [_DATA_KEY_B, varint(first), view[header_len : header_len + first]]
        self._piece(body, sum(len(p) for p in body), first)
        for start in range(header_len + first, len(raw), self.chunk):
            part = view[start : start + self.chunk]
            body = [*ref_f, _DATA_KEY_B, varint(len(part)), part]
            self._piece(body, sum(len(p) for p in body), len(part))

    def add_status(self, ref: int, status: int, detail: str = "") -> None:
        """A piece that only reports a status (not found, corrupt) for shard ``ref``."""
        body = [*_ref_field(ref), _STATUS_KEY_B, varint(status)]
        if detail:
            raw = detail.encode()
            body += [_DETAIL_KEY_B, varint(len(raw)), raw]
        self._piece(body, sum(len(p) for p in body), 0)

    def take(self, final: bool = False) -> list[bytes]:
        """Messages completed so far (with ``final``, also the partly filled one)."""
        if final:
            self._close()
        done, self._done = self._done, []
        return done


def _ref_field(ref: int) -> list[bytes | memoryview]:
    return [_REF_KEY_B, varint(ref)] if ref else []


def get_shards_request(refs: Sequence[tuple[bytes, int]], chunk_bytes: int) -> bytes:
    """The wire bytes of ``GetShardsRequest(refs=[ShardRef(object_id, index)...],
    chunk_bytes)``, as protobuf writes them: building one protobuf object per ref cost the
    client ~8% of its GIL time on a read of 3,072 shards."""
    parts: list[bytes] = []
    for oid, index in refs:
        body = b"\x0a" + varint(len(oid)) + oid + (b"\x10" + varint(index) if index else b"")
        parts += (b"\x0a", varint(len(body)), body)
    if chunk_bytes:
        parts += (b"\x10", varint(chunk_bytes))
    return b"".join(parts)


_PIECES_KEY_B, _REF_KEY_B, _STATUS_KEY_B = bytes([_PIECES_KEY]), bytes([_REF_KEY]), bytes([_STATUS_KEY])
_HEADER_KEY_B, _DATA_KEY_B, _DETAIL_KEY_B = bytes([_HEADER_KEY]), bytes([_DATA_KEY]), bytes([_DETAIL_KEY])


class WirePiece(NamedTuple):
    """One decoded ``ShardPiece``; ``header`` and ``data`` are views into the message."""

    ref: int
    status: int
    header: memoryview
    data: memoryview
    detail: str


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise WireError("truncated or overlong varint")


def _skip(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wire_type == 5:
        pos += 4
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("field runs past the end of its message")
    return pos


_LEN_FIELDS = frozenset((_HEADER_KEY, _DATA_KEY, _DETAIL_KEY))


def _decode_piece(buf: bytes, view: memoryview, pos: int, end: int) -> WirePiece:
    # One-byte varints (every key here, and most values) are read inline: this runs once
    # per shard on the read path.
    ref = status = 0
    header = data = _EMPTY
    detail = ""
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(buf, pos, end)
        if key in _LEN_FIELDS:
            n = buf[pos] if pos < end else 0x80
            if n < 0x80:
                pos += 1
            else:
                n, pos = _read_varint(buf, pos, end)
            stop = pos + n
            if stop > end:
                raise WireError("field runs past the end of its piece")
            if key == _DATA_KEY:
                data = view[pos:stop]
            elif key == _HEADER_KEY:
                header = view[pos:stop]
            else:
                detail = bytes(view[pos:stop]).decode(errors="replace")
            pos = stop
        elif key in (_REF_KEY, _STATUS_KEY):
            value = buf[pos] if pos < end else 0x80
            if value < 0x80:
                pos += 1
            else:
                value, pos = _read_varint(buf, pos, end)
            if key == _REF_KEY:
                ref = value
            else:
                status = value
        else:  # an unknown field: skipped, as protobuf does
            pos = _skip(buf, pos, end, key & 7)
    return WirePiece(ref, status, header, data, detail)


_EMPTY = memoryview(b"")


def iter_pieces(message: bytes) -> Iterator[WirePiece]:
    """The pieces of one serialized ``ShardPieces`` message, in order, without copying data.
    Raises WireError on a malformed message. The views keep ``message`` alive."""
    view = memoryview(message)
    pos, end = 0, len(message)
    while pos < end:
        key, pos = _read_varint(message, pos, end)
        if key != _PIECES_KEY:
            pos = _skip(message, pos, end, key & 7)
            continue
        n, pos = _read_varint(message, pos, end)
        if pos + n > end:
            raise WireError("piece runs past the end of the message")
        yield _decode_piece(message, view, pos, pos + n)
        pos += n
