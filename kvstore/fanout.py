"""Object-level writes and reads over k+m shard transports, batched per node (no gRPC here).

``write_objects`` sends the shards of a batch of objects with one stream per node and
reports, per object, which shards are durable. ``read_objects`` fans out to every shard of
every object (one stream per node) and decodes each object from the first k shards that
pass their checksums; the other m requests are the hedge against slow or dead nodes, and
their outcomes (missing, corrupt) are reported for repair once every reply is in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field

from kvstore.codec import Codec, TooFewShards
from kvstore.shardfmt import Shard
from kvstore.transport import (
    Cancel,
    NodeError,
    NodeUnavailable,
    Progress,
    ShardCorruptOnNode,
    ShardMissing,
    ShardResult,
    ShardTransport,
)


class StoreError(Exception):
    """Base class of the store client's errors."""


class WriteFailed(StoreError):
    """Too few shards became durable; the object was not committed (it is absent)."""


class ObjectUnavailable(StoreError):
    """Fewer than k valid shards could be read right now (nodes down or slow)."""


class ObjectLost(StoreError):
    """More than m nodes answered that their shard is gone (evicted, expired, deleted)."""


@dataclass(frozen=True)
class ObjectRef:
    """One object to read: its id and the node id holding each shard index."""

    object_id: bytes
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class WriteOutcome:
    mask: int  # shards durable
    errors: dict[int, str]


def write_objects(
    pool: Executor,
    transports: Mapping[str, ShardTransport],
    objects: Sequence[tuple[tuple[str, ...], Sequence[Shard]]],
    timeout_s: float,
    progress: Progress | None = None,
) -> list[WriteOutcome]:
    """Put shard i of each object on node ``nodes[i]``: one stream per node, all in parallel.
    Never raises for a node failure; the outcome says which shards are durable."""
    per_node: dict[str, list[tuple[int, Shard]]] = {}
    for obj, (nodes, shards) in enumerate(objects):
        for node, shard in zip(nodes, shards):
            per_node.setdefault(node, []).append((obj, shard))
    futs = {
        pool.submit(transports[node].put_shards, [s for _, s in items], timeout_s, progress): items
        for node, items in per_node.items()
    }
    wait(futs, timeout=timeout_s + 1.0)
    masks = [0] * len(objects)
    errors: list[dict[int, str]] = [{} for _ in objects]
    for fut, items in futs.items():
        results: list[NodeError | None]
        if fut.done() and fut.exception() is None:
            results = fut.result()
        else:
            results = [NodeError("?", "timed out")] * len(items)
        for (obj, shard), err in zip(items, results):
            if err is None:
                masks[obj] |= 1 << shard.index
            else:
                errors[obj][shard.index] = str(err)
    return [WriteOutcome(m, e) for m, e in zip(masks, errors)]


@dataclass
class _Gather:
    """Replies for one object, until k valid ones (or until no more can arrive)."""

    object_id: bytes
    n: int
    shards: list[Shard | None] = field(default_factory=list)
    valid: int = 0
    pending: int = 0
    missing: set[int] = field(default_factory=set)
    corrupt: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)
    state: int = 0  # _WAITING, then _CLAIMED by the one thread that makes its result, _DONE

    def __post_init__(self) -> None:
        self.shards = [None] * self.n
        self.pending = self.n

    def ready(self, k: int, m: int) -> bool:
        return self.valid >= k or self.pending == 0 or len(self.missing) > m


_WAITING, _CLAIMED, _DONE = 0, 1, 2


class _ReadBatch:
    """The replies of one read batch. Each object is decoded as soon as it is ready, by the
    thread whose reply made it ready (outside the lock), so decoding overlaps the transfer
    of the rest of the batch instead of following it."""

    def __init__(self, codec: Codec, objects: Sequence[ObjectRef], timeout_s: float) -> None:
        self.codec = codec
        self.k, self.m = codec.config.k, codec.config.m
        self.timeout_s = timeout_s
        self.gathers = [_Gather(o.object_id, len(o.nodes)) for o in objects]
        self.results: list[bytes | StoreError | None] = [None] * len(objects)
        self.cond = threading.Condition()
        self.outstanding = sum(g.n for g in self.gathers)
        self.unfinished = len(self.gathers)  # the waiter wakes once, when this reaches 0

    def on_replies(self, replies: Sequence[tuple[int, int, ShardResult]]) -> bool:
        """Record replies (object, shard index, result), checking shards before taking the
        lock, once for all of them; True when they included the last reply of the batch."""
        valid = self.codec.shard_ok
        checked = [
            (obj, i, r, isinstance(r, Shard) and valid(r, i, self.gathers[obj].object_id))
            for obj, i, r in replies
        ]
        claimed = []
        with self.cond:
            for obj, index, result, ok in checked:
                if self._record(self.gathers[obj], index, result, ok):
                    claimed.append(obj)
            self.outstanding -= len(checked)
            last = self.outstanding == 0
        for obj in claimed:
            self._finish(obj)
        return last

    def _record(self, g: _Gather, index: int, result: ShardResult, ok: bool) -> bool:
        """Count one reply (lock held); True when it made the object ready and this caller
        now owns making its result."""
        g.pending -= 1
        if ok:
            g.valid += 1
            if g.state == _WAITING:  # a finished object needs no more shards
                g.shards[index] = result  # type: ignore[assignment]
        elif isinstance(result, Shard):
            g.corrupt.add(index)
            g.errors[index] = "failed checksum at the client"
        else:
            g.errors[index] = str(result)
            if isinstance(result, ShardMissing):
                g.missing.add(index)
            elif isinstance(result, ShardCorruptOnNode):
                g.corrupt.add(index)
        if g.state == _WAITING and g.ready(self.k, self.m):
            g.state = _CLAIMED
            return True
        return False

    def _finish(self, obj: int) -> None:
        """Make the result of a claimed object (decoding outside the lock) and publish it."""
        with self.cond:
            g = self.gathers[obj]
            shards, valid, missing, errors = list(g.shards), g.valid, len(g.missing), dict(g.errors)
            g.shards = [None] * g.n  # the decoded object is all that is kept
        result = self._result(g.object_id, shards, valid, missing, errors)
        with self.cond:
            self.results[obj] = result
            g.state = _DONE
            self.unfinished -= 1
            if self.unfinished == 0:
                self.cond.notify_all()

    def _result(
        self, oid: bytes, shards: list[Shard | None], valid: int, missing: int, errors: dict[int, str]
    ) -> bytes | StoreError:
        if valid >= self.k:
            return self.codec.decode(shards, oid, checksums=False)  # checked on arrival
        detail = "; ".join(f"shard {i} {e}" for i, e in sorted(errors.items())) or "no replies in time"
        if missing > self.m:
            return ObjectLost(f"object {oid.hex()}: {missing} shards gone ({detail})")
        return ObjectUnavailable(
            f"object {oid.hex()}: {TooFewShards(valid, self.k)} within {self.timeout_s:.2f}s ({detail})"
        )

    def wait(self, deadline: float) -> list[bytes | StoreError]:
        """Every object's result: waits until all are made or the deadline passes; objects
        still short of shards then get their error here."""
        with self.cond:
            while self.unfinished > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            late = [o for o, g in enumerate(self.gathers) if g.state == _WAITING]
            for o in late:
                self.gathers[o].state = _CLAIMED
        for o in late:
            self._finish(o)
        with self.cond:  # objects another thread is decoding right now
            while self.unfinished > 0:
                self.cond.wait()
        return [r for r in self.results if r is not None]


def read_objects(
    pool: Executor,
    codec: Codec,
    transports: Mapping[str, ShardTransport],
    objects: Sequence[ObjectRef],
    timeout_s: float,
    on_settled: Callable[[int, set[int]], None] | None = None,
) -> list[bytes | StoreError]:
    """Decode each object from the first k valid shards of its group.

    One result per object: its bytes, ObjectLost (more than m live nodes report the shard
    gone) or ObjectUnavailable (fewer than k valid shards within ``timeout_s``). Stragglers
    are not cancelled: once every reply is in, ``on_settled(object position, bad indices)``
    is called for each object with shards missing or corrupt on a live node.
    """
    batch = _ReadBatch(codec, objects, timeout_s)
    per_node: dict[str, list[tuple[int, int]]] = {}
    for obj, ref in enumerate(objects):
        for index, node in enumerate(ref.nodes):
            per_node.setdefault(node, []).append((obj, index))
    cancel = Cancel()
    deadline = time.monotonic() + timeout_s
    for node, items in per_node.items():
        if node in transports:
            pool.submit(_read_node, batch, transports[node], items, timeout_s, cancel, on_settled)
        else:  # a node no longer in the client's membership: its shards are unavailable
            batch.on_replies(
                [(obj, index, NodeUnavailable(node, "not a known node")) for obj, index in items]
            )
    results = batch.wait(deadline)
    if any(not isinstance(r, bytes) for r in results):
        cancel.cancel()
    return results


def _read_node(
    batch: _ReadBatch,
    transport: ShardTransport,
    items: list[tuple[int, int]],
    timeout_s: float,
    cancel: Cancel,
    on_settled: Callable[[int, set[int]], None] | None,
) -> None:
    """One node's stream of a read batch; the last reply of the batch reports bad shards."""

    def on_shards(results: list[tuple[int, ShardResult]]) -> None:
        replies = [(*items[pos], result) for pos, result in results]
        if batch.on_replies(replies) and on_settled is not None:
            for o, g in enumerate(batch.gathers):
                if g.missing or g.corrupt:
                    on_settled(o, g.missing | g.corrupt)

    refs = [(batch.gathers[obj].object_id, index) for obj, index in items]
    transport.get_shards(refs, timeout_s, on_shards, cancel)
