"""The store client: prefix-cache semantics over erasure-coded objects on storage nodes.

``put_blocks(hashes, payloads, cls)`` stores the new blocks of a call, consecutive small
ones packed together into one object of up to ``group_bytes`` (a block group,
``kvstore.groups``); ``get_prefix(hashes)`` returns the payloads of the longest contiguous
cached run from the first block, reading each object once; ``touch`` refreshes LRU and TTL;
``delete`` removes blocks (an object goes with the last block that points at it).
Placement is rendezvous hashing of the block hash (a group's first block) over the node
ids, so every client agrees on an object's group of k+m nodes.

Write protocol (whole or absent): encode with a fresh object id, put all k+m shards in
parallel (each node writes atomically), and only if at least ``min_write_shards`` are
durable commit the directory entry; until that commit no reader can find the object. A
short write deletes what it wrote and raises ``WriteFailed``. Readers decode only shards
whose header carries the committed object id. No gRPC here: nodes are reached through
``kvstore.transport.ShardTransport``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.codec import Codec, CodecConfig, new_object_id
from kvstore.directory import BlockMeta, Directory, InMemoryDirectory
from kvstore.fanout import (
    ObjectLost,
    ObjectRef,
    ObjectUnavailable,
    StoreError,
    WriteFailed,
    read_objects,
    write_objects,
)
from kvstore.groups import GroupedObject, group_objects
from kvstore.health import NodeHealth
from kvstore.lazypool import LazyPool
from kvstore.placement import NodeAddress, place
from kvstore.refresh import ParityRefresher
from kvstore.repair import RepairWorker
from kvstore.retention import DEFAULT_TTL_S
from kvstore.shardfmt import TRAFFIC_CLASSES, class_code
from kvstore.transport import NodeError, Progress, ShardTransport

log = logging.getLogger(__name__)
__all__ = ["StoreClient", "StoreClientConfig", "StoreError", "WriteFailed", "ObjectUnavailable", "ObjectLost"]


@dataclass(frozen=True)
class StoreClientConfig:
    nodes: tuple[NodeAddress, ...]
    codec: CodecConfig = field(default_factory=CodecConfig)
    ttl_s: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TTL_S)
    min_write_shards: int | None = None  # None means k+1
    write_timeout_s: float = 10.0
    read_timeout_s: float = 2.0
    admin_timeout_s: float = 2.0
    chunk_bytes: int = 1 << 20
    shard_threads: int = 48
    batch_bytes: int = 64 << 20  # object bytes per batched put/get round
    background_repair: bool = True
    # Reads: a number asks k shards first (the data shards, parity in place of those on nodes
    # the client avoids after a failure, kvstore.health), and the rest for objects not yet
    # decoded when a shard fails or the read has run this many times as long as the fastest
    # node took (kvstore.fanout.read_objects). None asks every node of the group at once (k+m
    # shards, the m extra being the hedge). 5.0: measured here (bench kvstore, 12 nodes on 2
    # cores), data-first moves k/(k+m) of the bytes and gets ~1.2x the eager reads' GB/s;
    # at 2-3x the timer fires on ordinary scheduling noise and the gain is gone.
    hedge_factor: float | None = 5.0
    # Data-first reads leave parity unread, so a rotted parity shard would wait for a degraded
    # read to be found. This fraction of objects (chosen at random per read) is read whole,
    # which checks and, through repair, heals its parity: ~0.2% more bytes per read at 0.01.
    check_all_fraction: float = 0.01
    hedge_min_s: float = 0.002
    # put_blocks codes consecutive new blocks of a call together, up to this many bytes per
    # object (a block larger than this is an object of its own); 0 stores every block alone.
    group_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        n = self.codec.n
        if self.group_bytes < 0:
            raise ValueError(
                f"group_bytes must be >= 0 bytes (0 disables block groups), got {self.group_bytes}"
            )
        if len({nd.node_id for nd in self.nodes}) != len(self.nodes):
            raise ValueError("node ids must be unique")
        if len(self.nodes) < n:
            raise ValueError(f"{self.codec.k}+{self.codec.m} needs at least {n} nodes, got {len(self.nodes)}")
        if not self.codec.k <= self.write_quorum <= n:
            raise ValueError(f"min_write_shards must be within [k, k+m] = [{self.codec.k}, {n}]")
        if set(self.ttl_s) != set(TRAFFIC_CLASSES) or min(self.ttl_s.values()) <= 0:
            raise ValueError(
                f"ttl_s needs a positive TTL for exactly {sorted(TRAFFIC_CLASSES)}, got {dict(self.ttl_s)}"
            )
        if min(self.write_timeout_s, self.read_timeout_s, self.admin_timeout_s) <= 0:
            raise ValueError("timeouts must be positive seconds")
        if self.hedge_factor is not None and self.hedge_factor < 1.0 or self.hedge_min_s < 0:
            raise ValueError(
                f"hedge_factor must be None (ask all k+m shards at once) or >= 1, and hedge_min_s >= 0; "
                f"got {self.hedge_factor} and {self.hedge_min_s}"
            )
        if not 0.0 <= self.check_all_fraction <= 1.0:
            raise ValueError(f"check_all_fraction must be within [0, 1], got {self.check_all_fraction}")
        if self.shard_threads < n or self.batch_bytes < 1:
            raise ValueError(f"shard_threads must be >= k+m ({n}) and batch_bytes positive")

    @property
    def write_quorum(self) -> int:
        return self.codec.k + 1 if self.min_write_shards is None else self.min_write_shards


T = TypeVar("T")


def _batches(items: Sequence[T], max_bytes: int, size: Callable[[T], int] | None = None) -> Iterator[list[T]]:
    """Consecutive runs of ``items`` of at most ``max_bytes`` (one item always fits)."""
    measure = size or (lambda item: len(item[1]))  # type: ignore[index]
    batch: list[T] = []
    total = 0
    for item in items:
        n = measure(item)
        if batch and total + n > max_bytes:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


TransportFactory = Callable[[NodeAddress, int], ShardTransport]


def _grpc_transport(node: NodeAddress, chunk_bytes: int) -> ShardTransport:
    from kvstore.transport import GrpcShardTransport

    return GrpcShardTransport(node, chunk_bytes)


class StoreClient:
    def __init__(
        self,
        config: StoreClientConfig,
        directory: Directory | None = None,
        transport_factory: TransportFactory = _grpc_transport,
    ) -> None:
        self.config = config
        self.codec = Codec(config.codec)
        self.directory: Directory = directory if directory is not None else InMemoryDirectory()
        self.transports = {nd.node_id: transport_factory(nd, config.chunk_bytes) for nd in config.nodes}
        self._node_ids = [nd.node_id for nd in config.nodes]
        self._shard_pool = ThreadPoolExecutor(config.shard_threads, thread_name_prefix="kv-shard")
        self.health = NodeHealth()  # nodes whose streams failed: reads route around them
        self.parity_refresh = ParityRefresher(config.codec.k)  # parity that data-first reads skip
        self.repair = RepairWorker(self, background=config.background_repair)
        self._get_pool = LazyPool(2, "kv-get")  # get_prefix_async, started on first use

    # -- objects -------------------------------------------------------------------------
    def group(self, key: bytes) -> tuple[str, ...]:
        return place(key, self._node_ids, self.codec.config.n)

    def put_object(
        self, key: bytes, data: bytes, traffic_class: str = "chat", progress: Progress | None = None
    ) -> BlockMeta:
        """Store ``data`` under ``key`` (replacing an older object); whole or absent.
        Raises WriteFailed when fewer than the write quorum of shards became durable."""
        result = self._put_batch([(key, data, None)], traffic_class, progress)[0]
        if isinstance(result, WriteFailed):
            raise result
        return result[0]

    def _put_batch(
        self, items: Sequence[GroupedObject], traffic_class: str, progress: Progress | None = None
    ) -> list[list[BlockMeta] | WriteFailed]:
        """Write each object and commit the rows of its blocks; per object, its rows or why not."""
        code = class_code(traffic_class)
        plans = []
        for key, data, members in items:
            oid = new_object_id()
            blocks = members or [(key, 0, len(data))]
            plans.append(
                (key, oid, self.group(key), self.codec.encode(oid, data, code), blocks, members is not None)
            )
        outcomes = write_objects(
            self._shard_pool,
            self.transports,
            [(p[2], p[3]) for p in plans],
            self.config.write_timeout_s,
            progress,
        )
        results: list[list[BlockMeta] | WriteFailed] = []
        olds = iter(self.directory.lookup_many([k for p in plans for k, _, _ in p[4]]))
        commits: list[tuple[BlockMeta, float]] = []
        stale: list[tuple[str, bytes, int]] = []
        now_ms = int(time.time() * 1000)
        ttl = self.config.ttl_s[traffic_class]
        for (key, oid, nodes, _, blocks, grouped), out in zip(plans, outcomes):
            durable = bin(out.mask).count("1")
            if durable < self.config.write_quorum:
                self._delete_shards([(nodes[i], oid, i) for i in range(len(nodes)) if out.mask >> i & 1])
                detail = "; ".join(f"shard {i} on {nodes[i]}: {e}" for i, e in sorted(out.errors.items()))
                results.append(
                    WriteFailed(
                        f"block {key.hex()[:16]}: {durable} of {len(nodes)} shards durable, need "
                        f"{self.config.write_quorum}; nothing committed ({detail})"
                    )
                )
                for _ in blocks:
                    next(olds)
                continue
            size = sum(length for _, _, length in blocks)
            metas = [
                BlockMeta(
                    k, oid, nodes, size, traffic_class, out.mask, now_ms, off, length if grouped else None
                )
                for k, off, length in blocks
            ]
            for meta in metas:
                old = next(olds)
                # an old ungrouped object goes now; an old group's shards age out (TTL, LRU)
                if old is not None and old.object_id != oid and not old.grouped:
                    stale += [(n, old.object_id, i) for i, n in enumerate(old.nodes)]
                commits.append((meta, ttl))
            results.append(metas)
        self.directory.commit_many(commits)  # the objects become visible here, not before
        for result in results:
            if not isinstance(result, WriteFailed) and result[0].present != (1 << len(result[0].nodes)) - 1:
                self.repair.enqueue(result[0].key)
        self._delete_shards(stale)
        return results

    def get_object(self, meta: BlockMeta) -> bytes:
        """The bytes of a committed object; raises ObjectUnavailable or ObjectLost."""
        result = self._read([meta])[0]
        if isinstance(result, StoreError):
            raise result
        return result

    def _read(self, metas: Sequence[BlockMeta]) -> list[bytes | StoreError]:
        def settled(pos: int, bad: set[int]) -> None:
            self.repair.enqueue(metas[pos].key)

        refs = [ObjectRef(m.object_id, m.nodes) for m in metas]
        cfg = self.config
        return read_objects(
            self._shard_pool, self.codec, self.transports, refs, cfg.read_timeout_s, settled,
            cfg.hedge_factor, cfg.hedge_min_s, self.health, cfg.check_all_fraction,
        )  # fmt: skip

    # -- prefix-cache API ----------------------------------------------------------------
    def put_blocks(
        self, hashes: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = "chat"
    ) -> list[BlockMeta]:
        """Store the blocks not already cached, consecutive ones in groups of up to
        ``group_bytes`` per object, in batches with one stream per node; returns the
        metadata of every block stored. Raises WriteFailed (after committing the blocks that
        did succeed) when any block could not be written."""
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
        class_code(traffic_class)
        known = self.directory.lookup_many(hashes) if hashes else []
        new = {h: p for h, p, m in reversed(list(zip(hashes, payloads, known))) if m is None}
        todo = [(h, new.pop(h)) for h in hashes if h in new]  # the first of repeated hashes
        stored: list[BlockMeta] = []
        failures: list[WriteFailed] = []
        lost = 0
        for batch in _batches(group_objects(todo, self.config.group_bytes), self.config.batch_bytes):
            for obj, r in zip(batch, self._put_batch(batch, traffic_class)):
                if isinstance(r, WriteFailed):
                    failures.append(r)
                    lost += len(obj[2] or [0])
                else:
                    stored += r
        if failures:
            raise WriteFailed(f"{lost} of {len(todo)} blocks not stored; first: {failures[0]}")
        return stored

    def get_prefix(self, hashes: Sequence[bytes], touch: bool = True) -> list[memoryview]:
        """Payloads of the longest run of ``hashes`` (from the first) that is cached and
        readable; each object (a block, or a group of blocks) is read once. A block whose
        shards are gone (evicted, expired) ends the run and the entries of its object are
        dropped. Raises ObjectUnavailable when a block of the run cannot be read because
        nodes are down: an explicit error, never a silent truncation.

        Each payload is a read-only ``memoryview`` into the decoded object, not a copy
        (``torch.frombuffer`` and ``bytes()`` take it as it is); a view keeps its whole
        object alive, so a caller holding one block of a group for long should copy it."""
        metas = self.directory.lookup_prefix(hashes)
        objs: dict[bytes, BlockMeta] = {}  # first row of each object, in chain order
        for m in metas:
            objs.setdefault(m.object_id, m)
        got: dict[bytes, bytes | StoreError] = {}
        for batch in _batches(list(objs.values()), self.config.batch_bytes, size=lambda m: m.size):
            results = self._read(batch)
            got.update((m.object_id, r) for m, r in zip(batch, results))
            if any(isinstance(r, StoreError) for r in results):
                break  # the run ends in this batch
        out: list[memoryview] = []
        for meta in metas:
            result = got.get(meta.object_id)
            if result is None:
                break
            if isinstance(result, ObjectLost):
                self.directory.delete([m.key for m in metas if m.object_id == meta.object_id])
                break
            if isinstance(result, StoreError):
                raise result
            start, end = meta.span()
            view = memoryview(result)
            out.append(view if meta.length is None else view[start:end])
        if touch and out:  # off the read's critical path
            self._shard_pool.submit(self._refresh, list(hashes[: len(out)]), metas[: len(out)])
        return out

    def get_prefix_async(self, hashes: Sequence[bytes], touch: bool = True) -> Future[list[memoryview]]:
        """``get_prefix`` on a small pool of the client's own: returns at once, and the
        future carries the payloads or get_prefix's exception (ObjectUnavailable, a Redis
        error). A read not yet started when the client closes is cancelled."""
        return self._get_pool.submit(self.get_prefix, list(hashes), touch)

    def _refresh(self, keys: list[bytes], metas: list[BlockMeta]) -> None:
        """After a read: the directory rows' TTL, and the parity shards the read did not ask
        for (the nodes refreshed the shards they served; ``kvstore.refresh``)."""
        try:
            self.directory.touch(keys, self.config.ttl_s)
        except Exception as exc:  # noqa: BLE001 - a missed refresh only shortens a TTL
            log.warning("directory touch of %d blocks failed: %s", len(keys), exc)
        if self.config.hedge_factor is None:  # every shard was asked for
            return
        avoided = self.health.avoided()
        self._touch_shards(
            {n: refs for n, refs in self.parity_refresh.due(metas).items() if n not in avoided}
        )

    def touch(self, hashes: Sequence[bytes]) -> int:
        metas = [m for m in self.directory.lookup_many(hashes) if m is not None]
        by_node: dict[str, list[tuple[bytes, int]]] = {}
        for meta in {m.object_id: m for m in metas}.values():  # each object once
            for i, node in enumerate(meta.nodes):
                by_node.setdefault(node, []).append((meta.object_id, i))
        self._touch_shards(by_node)
        return self.directory.touch([m.key for m in metas], self.config.ttl_s)

    def _touch_shards(self, by_node: Mapping[str, list[tuple[bytes, int]]]) -> None:
        """Refresh shards' LRU and TTL on their nodes (node id -> (object id, index) refs);
        a node that fails only misses the refresh."""
        for node, refs in by_node.items():
            try:
                self.transports[node].touch(refs, self.config.admin_timeout_s)
            except NodeError as exc:
                log.debug("touch on %s failed: %s", node, exc)

    def delete(self, hashes: Sequence[bytes]) -> int:
        """Remove the blocks' entries; an object's shards go with the last entry naming it."""
        count, freed = self.directory.release(hashes)
        self._delete_shards([(n, m.object_id, i) for m in freed for i, n in enumerate(m.nodes)])
        return count

    def _delete_shards(self, refs: Sequence[tuple[str, bytes, int]]) -> None:
        by_node: dict[str, list[tuple[bytes, int]]] = {}
        for node, oid, idx in refs:
            by_node.setdefault(node, []).append((oid, idx))
        for node, items in by_node.items():
            try:
                self.transports[node].delete(items, self.config.admin_timeout_s)
            except NodeError as exc:  # orphans are reclaimed by the node's TTL/LRU
                log.debug("delete on %s failed: %s", node, exc)

    def health_check(self, timeout_s: float | None = None) -> dict[str, bool]:
        """Node id -> SERVING, waiting up to ``timeout_s`` for each connection to come up.
        The answers also update which nodes reads route around (``self.health``)."""
        t = self.config.admin_timeout_s if timeout_s is None else timeout_s
        futs = {n: self._shard_pool.submit(tr.health, t) for n, tr in self.transports.items()}
        serving = {n: f.result() for n, f in futs.items()}
        for node, ok in serving.items():
            if ok:
                self.health.answered(node)
            else:
                self.health.failed(node)
        return serving

    def close(self) -> None:
        self._get_pool.shutdown()  # before the shard pool its reads run on
        self.repair.stop()
        self._shard_pool.shutdown(wait=True, cancel_futures=True)
        for t in self.transports.values():
            t.close()
        self.directory.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
