"""The client side of the store node RPCs: the shard transport Protocol and its gRPC adapter.

The client core (``kvstore.client``) talks to nodes only through ``ShardTransport``; this
module is the one place the client touches gRPC. Failures are mapped to three named
errors: ``NodeUnavailable`` (down, unreachable, timed out), ``ShardMissing`` (the node
answered: not there) and ``ShardCorruptOnNode`` (the node's copy failed its checksum).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import grpc
import grpc.experimental
from sluice_proto import common_pb2, store_pb2, store_pb2_grpc

from kvstore.pieces import Packer, WireError, WirePiece, get_shards_request, iter_pieces, shard_pieces
from kvstore.placement import NodeAddress
from kvstore.shardfmt import HEADER_LEN, Shard, ShardFormatError, ShardHeader


class NodeError(Exception):
    """A shard RPC to one node failed."""

    def __init__(self, node_id: str, detail: str) -> None:
        self.node_id = node_id
        super().__init__(f"{node_id}: {detail}")


class NodeUnavailable(NodeError):
    pass


class ShardMissing(NodeError):
    pass


class ShardCorruptOnNode(NodeError):
    pass


class ShardRejectedByNode(NodeError):
    pass


class Cancel:
    """A cancellation handle shared by the caller and one in-flight read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[grpc.Call] = []
        self.cancelled = False

    def attach(self, call: grpc.Call) -> None:
        with self._lock:
            self._calls.append(call)
            if self.cancelled:
                call.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for call in self._calls:
                call.cancel()


Progress = Callable[[int, int], None]  # (shard index, payload bytes sent so far)
ShardResult = Shard | NodeError
# Called with the results completed by one received message: (position in the request,
# shard or error) pairs, so a consumer takes its lock once per message, not once per shard.
OnShards = Callable[[list[tuple[int, ShardResult]]], None]


class ShardTransport(Protocol):
    """Shard RPCs to one node. Every method raises a NodeError subclass on failure and is
    bounded by ``timeout_s``; none retries."""

    node_id: str

    def put_shard(self, shard: Shard, timeout_s: float, progress: Progress | None = None) -> None: ...

    def get_shard(
        self, object_id: bytes, index: int, timeout_s: float, cancel: Cancel | None = None
    ) -> Shard: ...

    def put_shards(
        self, shards: Sequence[Shard], timeout_s: float, progress: Progress | None = None
    ) -> list[NodeError | None]:
        """Store many shards in one stream; one outcome per shard (None when durable)."""
        ...

    def get_shards(
        self,
        refs: Sequence[tuple[bytes, int]],
        timeout_s: float,
        on_shards: OnShards,
        cancel: Cancel | None = None,
    ) -> None:
        """Read many shards in one stream. Every ref gets exactly one result (the Shard,
        unverified, or a NodeError), handed to ``on_shards`` in batches as they complete.
        Never raises: a broken stream reports NodeUnavailable for every ref not yet
        delivered."""
        ...

    def delete(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int: ...

    def touch(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int: ...

    def health(self, timeout_s: float) -> bool: ...

    def stats(self, timeout_s: float) -> store_pb2.NodeStatsReply: ...

    def close(self) -> None: ...


def _refs(refs: Sequence[tuple[bytes, int]]) -> store_pb2.ShardRefs:
    return store_pb2.ShardRefs(refs=[store_pb2.ShardRef(object_id=o, index=i) for o, i in refs])


def _report(
    shards: Sequence[Shard], pending: dict[int, int], sent: list[int], progress: Progress | None
) -> None:
    for pos, n in pending.items():
        sent[pos] += n
        if progress is not None:
            progress(shards[pos].index, sent[pos])
    pending.clear()


class _Assembler:
    """Turns a GetShards reply stream back into one result per ref. A payload that came in
    one piece is a view of the received message, not a copy (the message stays alive until
    the shard is dropped); one split over several pieces is joined once."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.delivered: set[int] = set()
        self.ready: list[tuple[int, ShardResult]] = []  # completed since the last take()
        self.pos, self.need = -1, 0
        self.header: ShardHeader | None = None
        self.parts: list[memoryview] = []

    def _deliver(self, pos: int, result: ShardResult) -> None:
        if pos not in self.delivered:
            self.delivered.add(pos)
            self.ready.append((pos, result))

    def take(self) -> list[tuple[int, ShardResult]]:
        ready, self.ready = self.ready, []
        return ready

    def feed(self, msg: WirePiece) -> None:
        if msg.status == store_pb2.SHARD_NOT_FOUND:
            self._deliver(msg.ref, ShardMissing(self.node_id, "NOT_FOUND"))
            return
        if msg.status != store_pb2.SHARD_OK:
            self._deliver(msg.ref, ShardCorruptOnNode(self.node_id, f"DATA_LOSS: {msg.detail}"))
            return
        if len(msg.header):
            self.pos, self.parts = msg.ref, []
            try:
                self.header = ShardHeader.unpack(msg.header)
            except ShardFormatError as exc:  # this shard only; the rest of the stream is fine
                self.pos, self.header = -1, None
                self._deliver(msg.ref, ShardCorruptOnNode(self.node_id, f"bad header in reply: {exc}"))
                return
            self.need = self.header.payload_len
        elif msg.ref != self.pos or self.header is None:
            return  # the rest of a shard whose header was bad
        self.parts.append(msg.data)
        self.need -= len(msg.data)
        if self.need <= 0:  # a view of the message when whole (the codec takes views)
            payload = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
            self._deliver(self.pos, Shard(self.header, payload))
            self.pos, self.header, self.parts = -1, None, []

    def fail_rest(self, n: int, err: NodeError) -> None:
        for pos in range(n):
            if pos not in self.delivered:
                self._deliver(pos, err)


class GrpcShardTransport:
    """``ShardTransport`` over one insecure loopback gRPC channel."""

    def __init__(self, node: NodeAddress, chunk_bytes: int = 1 << 20) -> None:
        self.node_id = node.node_id
        self.chunk_bytes = chunk_bytes
        limit = max(chunk_bytes, 4 << 20) + HEADER_LEN + 64 * 1024  # a node sends at most 4 MiB
        opts = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
            ("grpc.enable_retries", 0),
            # Server-streaming reads (GetShards) are consumed by the calling thread straight
            # from the call's completion queue. The default hands every message over from a
            # per-channel "spin" thread, which is also started and stopped with each read
            # when no other call is open: measured here, ~10% of the client's CPU.
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
        ]
        self._channel = grpc.insecure_channel(node.address, options=opts)
        self._stub = store_pb2_grpc.StoreNodeStub(self._channel)
        # GetShards replies are taken as bytes and read in place (kvstore.pieces.iter_pieces):
        # parsing them into protobuf objects would copy every payload byte twice more.
        self._get_shards_raw = self._channel.unary_stream(
            "/sluice.v1.StoreNode/GetShards",
            request_serializer=None,  # kvstore.pieces.get_shards_request writes the bytes
            response_deserializer=None,
            _registered_method=True,
        )

    def _error(self, exc: grpc.RpcError) -> NodeError:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        detail = f"{code.name if code else 'ERROR'}: {exc.details() if isinstance(exc, grpc.Call) else exc}"
        if code == grpc.StatusCode.NOT_FOUND:
            return ShardMissing(self.node_id, detail)
        if code == grpc.StatusCode.DATA_LOSS:
            return ShardCorruptOnNode(self.node_id, detail)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return ShardRejectedByNode(self.node_id, detail)
        return NodeUnavailable(self.node_id, detail)

    def _chunks(self, shard: Shard, progress: Progress | None) -> Iterator[store_pb2.PutShardChunk]:
        payload, step = memoryview(shard.payload), self.chunk_bytes
        yield store_pb2.PutShardChunk(header=shard.header.pack(), data=bytes(payload[:step]))
        if progress is not None:
            progress(shard.index, min(step, len(payload)))
        for start in range(step, len(payload), step):
            yield store_pb2.PutShardChunk(data=bytes(payload[start : start + step]))
            if progress is not None:
                progress(shard.index, min(start + step, len(payload)))

    def put_shard(self, shard: Shard, timeout_s: float, progress: Progress | None = None) -> None:
        try:
            self._stub.PutShard(self._chunks(shard, progress), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def get_shard(
        self, object_id: bytes, index: int, timeout_s: float, cancel: Cancel | None = None
    ) -> Shard:
        req = store_pb2.GetShardRequest(
            ref=store_pb2.ShardRef(object_id=object_id, index=index), chunk_bytes=self.chunk_bytes
        )
        try:
            call = self._stub.GetShard(req, timeout=timeout_s)
            if cancel is not None:
                cancel.attach(call)
            header, parts = b"", []
            for msg in call:
                if msg.header:
                    header = msg.header
                parts.append(msg.data)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        if not header:
            raise ShardCorruptOnNode(self.node_id, "reply carried no shard header")
        # Parsed but not verified here: the caller checks every shard against the object.
        return Shard.from_parts(header, b"".join(parts), verify=False)

    def _batch_messages(
        self, shards: Sequence[Shard], progress: Progress | None
    ) -> Iterator[store_pb2.ShardPieces]:
        packer = Packer(self.chunk_bytes)
        sent = [0] * len(shards)  # payload bytes of each shard handed to gRPC so far
        pending: dict[int, int] = {}
        for pos, shard in enumerate(shards):
            for piece in shard_pieces(pos, shard.header.pack(), shard.payload, self.chunk_bytes):
                pending[pos] = pending.get(pos, 0) + len(piece.data)
                msg = packer.add(piece)
                if msg is not None:
                    yield msg
                    _report(shards, pending, sent, progress)
        msg = packer.flush()
        if msg is not None:
            yield msg
            _report(shards, pending, sent, progress)

    def put_shards(
        self, shards: Sequence[Shard], timeout_s: float, progress: Progress | None = None
    ) -> list[NodeError | None]:
        try:
            reply = self._stub.PutShards(self._batch_messages(shards, progress), timeout=timeout_s)
        except grpc.RpcError as exc:
            err = self._error(exc)
            return [err] * len(shards)
        out: list[NodeError | None] = []
        for i in range(len(shards)):
            if i < len(reply.status) and reply.status[i] == store_pb2.SHARD_OK:
                out.append(None)
            else:
                why = reply.detail[i] if i < len(reply.detail) else "no result from the node"
                out.append(ShardRejectedByNode(self.node_id, why))
        return out

    def get_shards(
        self,
        refs: Sequence[tuple[bytes, int]],
        timeout_s: float,
        on_shards: OnShards,
        cancel: Cancel | None = None,
    ) -> None:
        req = get_shards_request(refs, self.chunk_bytes)
        asm = _Assembler(self.node_id)
        try:
            call = self._get_shards_raw(req, timeout=timeout_s)
            if cancel is not None:
                cancel.attach(call)
            for msg in call:
                for piece in iter_pieces(msg):
                    asm.feed(piece)
                if asm.ready:
                    on_shards(asm.take())
        except grpc.RpcError as exc:
            asm.fail_rest(len(refs), self._error(exc))
        except WireError as exc:
            call.cancel()
            asm.fail_rest(len(refs), ShardCorruptOnNode(self.node_id, f"malformed reply: {exc}"))
        asm.fail_rest(len(refs), ShardMissing(self.node_id, "not in the reply"))
        if asm.ready:
            on_shards(asm.take())

    def delete(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int:
        try:
            return int(self._stub.DeleteShards(_refs(refs), timeout=timeout_s).count)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def touch(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int:
        try:
            return int(self._stub.TouchShards(_refs(refs), timeout=timeout_s).count)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def health(self, timeout_s: float) -> bool:
        try:
            reply = self._stub.Health(common_pb2.HealthRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError:
            return False
        return bool(reply.state == common_pb2.HealthReply.SERVING)

    def stats(self, timeout_s: float) -> store_pb2.NodeStatsReply:
        try:
            return self._stub.NodeStats(store_pb2.NodeStatsRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        self._channel.close()
