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
from sluice_proto import common_pb2, store_pb2, store_pb2_grpc

from kvstore.placement import NodeAddress
from kvstore.shardfmt import HEADER_LEN, Shard


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


class ShardTransport(Protocol):
    """Shard RPCs to one node. Every method raises a NodeError subclass on failure and is
    bounded by ``timeout_s``; none retries."""

    node_id: str

    def put_shard(self, shard: Shard, timeout_s: float, progress: Progress | None = None) -> None: ...

    def get_shard(
        self, object_id: bytes, index: int, timeout_s: float, cancel: Cancel | None = None
    ) -> Shard: ...

    def delete(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int: ...

    def touch(self, refs: Sequence[tuple[bytes, int]], timeout_s: float) -> int: ...

    def health(self, timeout_s: float) -> bool: ...

    def stats(self, timeout_s: float) -> store_pb2.NodeStatsReply: ...

    def close(self) -> None: ...


def _refs(refs: Sequence[tuple[bytes, int]]) -> store_pb2.ShardRefs:
    return store_pb2.ShardRefs(refs=[store_pb2.ShardRef(object_id=o, index=i) for o, i in refs])


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
        ]
        self._channel = grpc.insecure_channel(node.address, options=opts)
        self._stub = store_pb2_grpc.StoreNodeStub(self._channel)

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
