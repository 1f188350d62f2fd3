"""The storage node: a thin gRPC adapter over ``kvstore.shardstore.ShardStore``.

Run as its own process (``python -m kvstore.node`` or ``sluice store node``) so it can be
killed and restarted. When serving, it writes ``<data-dir>/node.addr`` (host:port) so a
launcher that asked for port 0 learns the bound port. Prometheus metrics are served on
``--metrics-port`` when given (0: any free port, written to ``<data-dir>/metrics.addr`` before
``node.addr``); a background thread sweeps TTL and LRU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import start_http_server
from sluice_proto import common_pb2, store_pb2, store_pb2_grpc

from kvstore.nodemetrics import NodeMetrics
from kvstore.pieces import WirePacker
from kvstore.retention import RetentionConfig
from kvstore.scrub import Scrubber
from kvstore.shardfmt import HEADER_LEN, OBJECT_ID_LEN, ShardFormatError, ShardHeader
from kvstore.shardstore import (
    CapacityExceeded,
    ShardCorrupt,
    ShardNotFound,
    ShardRejected,
    ShardStore,
    ShardWriter,
)

log = logging.getLogger(__name__)
MiB = 1 << 20
MAX_BATCH = 4096  # shards per batched stream
SERVICE = "sluice.v1.StoreNode"


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    data_dir: Path
    capacity_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    max_shard_bytes: int = 64 * MiB
    chunk_bytes: int = 1 * MiB
    fsync: bool = True
    sweep_interval_s: float = 5.0
    metrics_port: int | None = None
    workers: int = 16
    cache_bytes: int = 256 * MiB  # hot cache of recently read shards; 0 turns it off
    scrub_bytes_per_s: int = 16 * MiB  # every shard file re-read and checked at this rate; 0: off
    scrub_period_s: float = 86400.0  # a scrub pass starts this often (the first after 10 min)
    scrub_first_after_s: float = 600.0

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"--capacity must be positive, got {self.capacity_bytes}")
        if self.cache_bytes < 0:
            raise ValueError(f"--cache-bytes must be >= 0 (0 turns the cache off), got {self.cache_bytes}")
        if not 64 * 1024 <= self.chunk_bytes <= 4 * MiB:
            raise ValueError(f"chunk size {self.chunk_bytes} must be within [64 KiB, 4 MiB]")
        if self.max_shard_bytes <= 0 or self.sweep_interval_s <= 0 or self.workers <= 0:
            raise ValueError("max shard bytes, sweep interval and workers must be positive")
        if self.scrub_bytes_per_s < 0 or self.scrub_period_s <= 0 or self.scrub_first_after_s < 0:
            raise ValueError("--scrub-rate must be >= 0 (0 turns scrubbing off), --scrub-period positive")

    @property
    def max_message_bytes(self) -> int:
        return self.chunk_bytes + HEADER_LEN + 64 * 1024


def _ref(ref: store_pb2.ShardRef, context: grpc.ServicerContext) -> tuple[bytes, int]:
    if len(ref.object_id) != OBJECT_ID_LEN or ref.index > 255:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "shard ref needs a 16-byte object id and index < 256")
    return bytes(ref.object_id), int(ref.index)


class _PutBatch:
    """The shards of one PutShards stream: each checked as it completes, committed together."""

    def __init__(self, servicer: StoreNodeServicer) -> None:
        self._servicer = servicer
        self.statuses: list[store_pb2.ShardStatus] = []
        self.details: list[str] = []
        self._sealed: list[ShardWriter] = []
        self._writer: ShardWriter | None = None

    def _result(self, status: store_pb2.ShardStatus, detail: str = "") -> None:
        self.statuses.append(status)
        self.details.append(detail)

    def _seal(self) -> None:
        w, self._writer = self._writer, None
        if w is None:
            return
        try:
            w.seal()
        except ShardRejected as exc:
            self._result(store_pb2.SHARD_REJECTED, str(exc))
            return
        self._sealed.append(w)
        self._result(store_pb2.SHARD_OK)

    def feed(self, piece: store_pb2.ShardPiece) -> bool:
        """Take one piece; False when the stream holds too many shards."""
        if piece.header:
            self._seal()
            if len(self.statuses) >= MAX_BATCH:
                return False
            try:
                self._writer = self._servicer._begin(ShardHeader.unpack(piece.header))
            except (ShardFormatError, CapacityExceeded) as exc:
                self._result(store_pb2.SHARD_REJECTED, str(exc))
                return True
        if piece.data and self._writer is not None:
            try:
                self._writer.write(piece.data)
            except ShardRejected as exc:
                self._writer.abort()
                self._writer = None
                self._result(store_pb2.SHARD_REJECTED, str(exc))
        return True

    def commit(self) -> list[int]:
        self._seal()
        sealed, self._sealed = self._sealed, []
        return self._servicer.store.commit(sealed)  # acknowledged only after this returns

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for w in self._sealed:
            w.abort()
        self._sealed = []


class StoreNodeServicer(store_pb2_grpc.StoreNodeServicer):
    def __init__(self, config: NodeConfig, store: ShardStore) -> None:
        self.config, self.store = config, store
        self.metrics = NodeMetrics(store, config.node_id)

    def PutShard(self, request_iterator: Iterator[store_pb2.PutShardChunk], context: grpc.ServicerContext):  # noqa: N802
        writer = None
        try:
            for msg in request_iterator:
                if writer is None:
                    writer = self._begin(ShardHeader.unpack(msg.header))
                elif msg.header:
                    raise ShardRejected("header sent twice in one PutShard stream")
                if msg.data:
                    writer.write(msg.data)
            if writer is None:
                raise ShardRejected("empty PutShard stream")
            stored = writer.commit()
            writer = None
        except (ShardFormatError, ShardRejected) as exc:
            self.metrics.puts_rejected.inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityExceeded as exc:
            self.metrics.puts_too_large.inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            if writer is not None:
                writer.abort()
        self.metrics.puts_ok.inc()
        self.metrics.bytes_in.inc(stored)
        return store_pb2.PutShardReply(stored_bytes=stored)

    def GetShard(self, request: store_pb2.GetShardRequest, context: grpc.ServicerContext):  # noqa: N802
        oid, idx = _ref(request.ref, context)
        try:
            shard = self.store.get(oid, idx)
        except ShardNotFound:
            self.metrics.gets_not_found.inc()
            context.abort(grpc.StatusCode.NOT_FOUND, f"shard {oid.hex()}.{idx} not on {self.config.node_id}")
        except ShardCorrupt as exc:
            self.metrics.gets_corrupt.inc()
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        chunk = min(request.chunk_bytes or self.config.chunk_bytes, self.config.chunk_bytes)
        payload = memoryview(shard.payload)
        self.metrics.gets_ok.inc()
        self.metrics.bytes_out.inc(HEADER_LEN + len(payload))
        yield store_pb2.GetShardChunk(header=shard.header.pack(), data=bytes(payload[:chunk]))
        for start in range(chunk, len(payload), chunk):
            yield store_pb2.GetShardChunk(data=bytes(payload[start : start + chunk]))

    def PutShards(self, request_iterator: Iterator[store_pb2.ShardPieces], context: grpc.ServicerContext):  # noqa: N802
        batch = _PutBatch(self)
        try:
            for msg in request_iterator:
                for piece in msg.pieces:
                    if not batch.feed(piece):
                        context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_BATCH} shards in one stream"
                        )
            sizes = batch.commit()
        finally:
            batch.abort()  # no-op after a commit; otherwise nothing half-written stays
        self.metrics.puts_ok.inc(len(sizes))
        self.metrics.bytes_in.inc(sum(sizes))
        return store_pb2.PutShardsReply(status=batch.statuses, detail=batch.details)

    def _begin(self, header: ShardHeader) -> ShardWriter:
        if header.payload_len > self.config.max_shard_bytes:
            raise CapacityExceeded(
                f"shard of {header.payload_len} bytes exceeds --max-shard-bytes {self.config.max_shard_bytes}"
            )
        return self.store.begin_put(header)

    def GetShards(self, request: store_pb2.GetShardsRequest, context: grpc.ServicerContext):  # noqa: N802
        """Replies are ``ShardPieces`` messages written as bytes (``WirePacker``): one copy
        of each shard's stored bytes per reply, instead of three through protobuf objects."""
        if len(request.refs) > MAX_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_BATCH} refs in one request")
        chunk = min(request.chunk_bytes or self.config.chunk_bytes, self.config.chunk_bytes)
        refs = [_ref(r, context) for r in request.refs]
        packer = WirePacker(chunk)
        counts = [0, 0, 0, 0]  # ok, not found, corrupt, bytes out: metrics once per request
        try:
            for pos, (oid, idx) in enumerate(refs):
                self._pack_shard(packer, pos, oid, idx, counts)
                yield from packer.take()
            yield from packer.take(final=True)
        finally:
            m = self.metrics
            for counter, n in zip((m.gets_ok, m.gets_not_found, m.gets_corrupt, m.bytes_out), counts):
                if n:
                    counter.inc(n)

    def _pack_shard(self, packer: WirePacker, pos: int, oid: bytes, idx: int, counts: list[int]) -> None:
        try:
            raw = self.store.get_raw(oid, idx)
        except ShardNotFound:
            counts[1] += 1
            packer.add_status(pos, store_pb2.SHARD_NOT_FOUND)
            return
        except ShardCorrupt as exc:
            counts[2] += 1
            packer.add_status(pos, store_pb2.SHARD_CORRUPT, str(exc))
            return
        counts[0] += 1
        counts[3] += len(raw)
        packer.add_shard(pos, raw, HEADER_LEN)

    def DeleteShards(self, request: store_pb2.ShardRefs, context: grpc.ServicerContext):  # noqa: N802
        refs = [_ref(r, context) for r in request.refs]
        return store_pb2.CountReply(count=self.store.delete(refs))

    def TouchShards(self, request: store_pb2.ShardRefs, context: grpc.ServicerContext):  # noqa: N802
        refs = [_ref(r, context) for r in request.refs]
        return store_pb2.CountReply(count=self.store.touch(refs))

    def StatShard(self, request: store_pb2.ShardRef, context: grpc.ServicerContext):  # noqa: N802
        st = self.store.stat(*_ref(request, context))
        if st is None:
            return store_pb2.StatShardReply(exists=False)
        size, tclass, last, expires = st
        return store_pb2.StatShardReply(
            exists=True, size=size, traffic_class=tclass, last_access_unix=last, expires_unix=expires
        )

    def NodeStats(self, request: store_pb2.NodeStatsRequest, context: grpc.ServicerContext):  # noqa: N802
        s = self.store.stats()
        return store_pb2.NodeStatsReply(
            node_id=self.config.node_id, used_bytes=s.used_bytes, capacity_bytes=s.capacity_bytes,
            shard_count=s.shard_count, evicted_shards=s.evicted, expired_shards=s.expired,
            discarded_at_start=s.discarded_at_start, corrupt_detected=s.corrupt_detected,
            cache_used_bytes=s.cache_used_bytes, cache_hits=s.cache_hits, cache_misses=s.cache_misses,
        )  # fmt: skip

    def Health(self, request: common_pb2.HealthRequest, context: grpc.ServicerContext):  # noqa: N802
        return common_pb2.HealthReply(state=common_pb2.HealthReply.SERVING, version="0.1.0")


class _HandlerCapture:
    """Stands in for a server to capture the generated method handlers."""

    handlers: dict[str, grpc.RpcMethodHandler]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = dict(handlers)


def _add_servicer(servicer: StoreNodeServicer, server: grpc.Server) -> None:
    """The generated handlers, except that GetShards yields already serialized
    ``ShardPieces`` bytes (``kvstore.pieces.WirePacker``), so gRPC passes them through."""
    capture = _HandlerCapture()
    store_pb2_grpc.add_StoreNodeServicer_to_server(servicer, capture)
    handlers = capture.handlers
    handlers["GetShards"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetShards,
        request_deserializer=store_pb2.GetShardsRequest.FromString,
        response_serializer=None,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class StoreNodeServer:
    """Owns the ShardStore, the gRPC server, the sweeper thread and the metrics endpoint."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = ShardStore(
            config.data_dir, config.capacity_bytes, config.retention, fsync=config.fsync,
            cache_bytes=config.cache_bytes,
        )  # fmt: skip
        self.servicer = StoreNodeServicer(config, self.store)
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers), options=opts)
        _add_servicer(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        self.metrics_port: int | None = None
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="store-sweeper", daemon=True)
        self.scrubber: Scrubber | None = None
        if config.scrub_bytes_per_s > 0:
            self.scrubber = Scrubber(
                self.store, config.scrub_bytes_per_s, config.scrub_period_s, self._stop.wait,
                first_after_s=config.scrub_first_after_s,
            )  # fmt: skip
            self.servicer.metrics.watch_scrubber(self.scrubber)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> StoreNodeServer:
        self.server.start()
        self._sweeper.start()
        if self.scrubber is not None:
            threading.Thread(target=self.scrubber.loop, name="store-scrubber", daemon=True).start()
        if self.config.metrics_port is not None:
            httpd, _ = start_http_server(
                self.config.metrics_port, addr=self.config.host, registry=self.servicer.metrics.registry
            )
            self.metrics_port = httpd.server_address[1]
            self._publish("metrics.addr", f"{self.config.host}:{self.metrics_port}")
        self._publish("node.addr", self.address)  # last: its presence means "ready"
        return self

    def _publish(self, name: str, address: str) -> None:
        """Write ``address`` to ``<data-dir>/name`` atomically, for a launcher that asked for port 0."""
        tmp = self.config.data_dir / f"{name}.tmp"
        tmp.write_text(address + "\n")
        os.replace(tmp, self.config.data_dir / name)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            expired, evicted = self.store.sweep()
            if expired or evicted:
                log.info("%s: swept %d expired, %d evicted shards", self.config.node_id, expired, evicted)

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


if __name__ == "__main__":  # the launcher's entry point: ``python -m kvstore.node ARGS``
    from kvstore.nodecli import main

    raise SystemExit(main())
