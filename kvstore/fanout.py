"""Object-level writes and reads over k+m shard transports, batched per node (no gRPC here).

``write_objects`` sends the shards of a batch of objects with one stream per node and
reports, per object, which shards are durable. ``read_objects`` asks, with one stream per
node, for k shards of every object (the data shards, a parity shard standing in for each
one on a node the client avoids) and decodes each object from the first k shards that pass
their checksums; the other m shards are the hedge against slow or failing nodes, asked for
when a shard fails or a node is late (or at once, in the eager mode). Outcomes (missing,
corrupt) are reported for repair once every reply is in.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field

from kvstore.codec import Codec, TooFewShards
from kvstore.health import NodeHealth
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
    asked: int = 0  # bit i: shard i has been asked for

    def __post_init__(self) -> None:
        self.shards = [None] * self.n

    @property
    def hedged(self) -> bool:
        """Every shard has been asked for: no more can be."""
        return self.asked == (1 << self.n) - 1

    def ready(self, k: int, m: int) -> bool:
        return self.valid >= k or len(self.missing) > m or (self.pending == 0 and self.hedged)


_WAITING, _CLAIMED, _DONE = 0, 1, 2


class _ReadBatch:
    """The replies of one read batch. Each object is decoded as soon as it is ready, by the
    thread whose reply made it ready (outside the lock), so decoding overlaps the transfer
    of the rest of the batch instead of following it."""

    def __init__(
        self,
        codec: Codec,
        objects: Sequence[ObjectRef],
        timeout_s: float,
        first: Sequence[Sequence[int]],
        on_settled: Callable[[int, set[int]], None] | None = None,
        health: NodeHealth | None = None,
    ) -> None:
        """``first[o]``: the shard indices of object o asked for at first. ``on_settled`` and
        ``health`` as in ``read_objects``; ``cancel`` ends the batch's streams."""
        self.codec = codec
        self.objects = objects
        self.on_settled, self.health = on_settled, health
        self.cancel = Cancel()
        self.k, self.m = codec.config.k, codec.config.m
        self.timeout_s = timeout_s
        self.gathers = [
            _Gather(o.object_id, len(o.nodes), pending=len(ask), asked=sum(1 << i for i in ask))
            for o, ask in zip(objects, first)
        ]
        self.results: list[bytes | StoreError | None] = [None] * len(objects)
        self.cond = threading.Condition()
        self.outstanding = sum(g.pending for g in self.gathers)
        self.unfinished = len(self.gathers)
        self.need_hedge = False  # a data shard failed before its parity was asked for
        self.first_stream_s: float | None = None  # how long the fastest node took for its share

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
            hedge = self.need_hedge
            for obj, index, result, ok in checked:
                if self._record(self.gathers[obj], index, result, ok):
                    claimed.append(obj)
            self.outstanding -= len(checked)
            last = self.outstanding == 0
            if self.need_hedge and not hedge:
                self.cond.notify_all()
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
            self.need_hedge |= not g.hedged
        else:
            self.need_hedge |= not g.hedged
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

    def stream_done(self, seconds: float) -> None:
        with self.cond:
            if self.first_stream_s is None:
                self.first_stream_s = seconds
                self.cond.notify_all()

    def wait_for_hedge(self, start: float, deadline: float, factor: float, min_s: float) -> None:
        """Until every object is finished, a data shard failed, or the read has run
        ``factor`` times as long as the fastest node took for its whole share."""
        with self.cond:
            while self.unfinished > 0 and not self.need_hedge:
                now = time.monotonic()
                at = deadline
                if self.first_stream_s is not None:
                    at = min(deadline, start + max(min_s, factor * self.first_stream_s))
                if now >= at:
                    return
                self.cond.wait(at - now)

    def hedge(self) -> list[tuple[int, int]]:
        """Ask for the shards not asked for yet of every object not finished: (object, index)."""
        refs = []
        with self.cond:
            for obj, g in enumerate(self.gathers):
                if g.state == _WAITING and not g.hedged:
                    rest = [i for i in range(g.n) if not g.asked >> i & 1]
                    g.asked |= sum(1 << i for i in rest)
                    g.pending += len(rest)
                    refs += [(obj, index) for index in rest]
            self.outstanding += len(refs)
        return refs

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


def first_shards(nodes: Sequence[str], k: int, avoid: Collection[str]) -> list[int]:
    """The k shard indices a data-first read asks for at first: the data shards, each one
    held by a node in ``avoid`` replaced by the first parity shard on a node not avoided
    (nodes avoided still fill the k when too few others are left)."""
    order = [i for i, node in enumerate(nodes) if node not in avoid]
    if len(order) < k:
        order += [i for i, node in enumerate(nodes) if node in avoid]
    return sorted(order[:k])


def read_objects(
    pool: Executor,
    codec: Codec,
    transports: Mapping[str, ShardTransport],
    objects: Sequence[ObjectRef],
    timeout_s: float,
    on_settled: Callable[[int, set[int]], None] | None = None,
    hedge_factor: float | None = None,
    hedge_min_s: float = 0.002,
    health: NodeHealth | None = None,
    check_all_fraction: float = 0.0,
) -> list[bytes | StoreError]:
    """Decode each object from the first k valid shards of its group.

    One result per object: its bytes, ObjectLost (more than m live nodes report the shard
    gone) or ObjectUnavailable (fewer than k valid shards within ``timeout_s``). Stragglers
    are not cancelled: once every reply is in, ``on_settled(object position, bad indices)``
    is called for each object with shards missing or corrupt on a live node.

    ``hedge_factor`` None asks for all k+m shards at once (the m extra are the hedge).
    Otherwise k shards are asked for first (``first_shards``: the data shards, with parity
    in place of those on nodes ``health`` avoids), and the other shards of every object not
    yet decoded follow as soon as a shard fails, or once the read has run ``hedge_factor``
    times as long as the fastest node took for its whole share (and at least
    ``hedge_min_s``): a slow node is hedged against, but a read moves k/(k+m) of the bytes.
    ``health`` is told which nodes failed and which answered. A random
    ``check_all_fraction`` of the objects of a data-first read ask for every shard anyway,
    so parity that rotted on a node is found (and repaired) by reads too.
    """
    k, n = codec.config.k, codec.config.n
    eager = hedge_factor is None or codec.config.m == 0
    first: list[Sequence[int]]
    if eager:
        first = [range(n)] * len(objects)
    else:
        avoid = health.avoided() if health is not None else frozenset()
        every = range(n)
        first = [
            every
            if check_all_fraction and random.random() < check_all_fraction
            else first_shards(o.nodes, k, avoid)
            for o in objects
        ]
    batch = _ReadBatch(codec, objects, timeout_s, first, on_settled, health)
    start = time.monotonic()
    deadline = start + timeout_s
    _submit(pool, batch, transports, [(o, i) for o, ask in enumerate(first) for i in ask], timeout_s)
    if hedge_factor is not None and not eager:
        batch.wait_for_hedge(start, deadline, hedge_factor, hedge_min_s)
        late = batch.hedge()
        if late:
            left = max(0.001, deadline - time.monotonic())
            _submit(pool, batch, transports, late, left)
    results = batch.wait(deadline)
    if any(not isinstance(r, bytes) for r in results):
        batch.cancel.cancel()
    return results


def _submit(
    pool: Executor,
    batch: _ReadBatch,
    transports: Mapping[str, ShardTransport],
    refs: Sequence[tuple[int, int]],
    timeout_s: float,
) -> None:
    """One stream per node for ``refs`` (object, shard index)."""
    per_node: dict[str, list[tuple[int, int]]] = {}
    for obj, index in refs:
        per_node.setdefault(batch.objects[obj].nodes[index], []).append((obj, index))
    for node, items in per_node.items():
        if node in transports:
            pool.submit(_read_node, batch, transports[node], items, timeout_s)
        else:  # a node no longer in the client's membership: its shards are unavailable
            batch.on_replies(
                [(obj, index, NodeUnavailable(node, "not a known node")) for obj, index in items]
            )


def _read_node(
    batch: _ReadBatch, transport: ShardTransport, items: list[tuple[int, int]], timeout_s: float
) -> None:
    """One node's stream of a read batch; the last reply of the batch reports bad shards."""
    answered = False
    on_settled, health = batch.on_settled, batch.health

    def on_shards(results: list[tuple[int, ShardResult]]) -> None:
        nonlocal answered
        answered = answered or any(not isinstance(r, NodeUnavailable) for _, r in results)
        replies = [(*items[pos], result) for pos, result in results]
        if batch.on_replies(replies) and on_settled is not None:
            for o, g in enumerate(batch.gathers):
                if g.missing or g.corrupt:
                    on_settled(o, g.missing | g.corrupt)

    refs = [(batch.gathers[obj].object_id, index) for obj, index in items]
    start = time.monotonic()
    transport.get_shards(refs, timeout_s, on_shards, batch.cancel)
    batch.stream_done(time.monotonic() - start)
    if health is not None:
        if answered:
            health.answered(transport.node_id)
        elif not batch.cancel.cancelled:  # its own read gave up on it: no verdict on the node
            health.failed(transport.node_id)
