"""Object-level writes and reads over k+m shard transports (no gRPC here).

``write_object`` sends the k+m shards in parallel and reports which ones are durable.
``read_object`` fans out to every shard of the group and decodes from the first k that
pass their checksums; the remaining requests are the hedge against slow or dead nodes,
and their outcomes (missing, corrupt) are reported for repair.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field

from kvstore.codec import Codec, TooFewShards
from kvstore.shardfmt import Shard
from kvstore.transport import (
    Cancel,
    NodeError,
    Progress,
    ShardCorruptOnNode,
    ShardMissing,
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


@dataclass
class ReadOutcome:
    data: bytes
    bad: set[int] = field(default_factory=set)  # shards missing or corrupt on a live node
    done: threading.Event = field(default_factory=threading.Event)  # all replies are in


def write_object(
    pool: Executor,
    transports: Sequence[ShardTransport],
    shards: Sequence[Shard],
    timeout_s: float,
    progress: Progress | None = None,
) -> tuple[int, dict[int, str]]:
    """Put shard i on transports[i], all in parallel. Returns (mask of durable shards,
    {index: error} for the others). Never raises for a node failure."""
    futures = {
        pool.submit(t.put_shard, s, timeout_s, progress): i
        for i, (t, s) in enumerate(zip(transports, shards))
    }
    wait(futures, timeout=timeout_s + 1.0)
    mask, errors = 0, {}
    for fut, i in futures.items():
        if not fut.done():
            errors[i] = "timed out"
            continue
        exc = fut.exception()
        if exc is None:
            mask |= 1 << i
        else:
            errors[i] = str(exc)
    return mask, errors


class _Gather:
    """Collects shard replies until k valid ones (or until no more can arrive)."""

    def __init__(self, codec: Codec, object_id: bytes, n: int) -> None:
        self.codec, self.object_id = codec, object_id
        self.k, self.m = codec.config.k, codec.config.m
        self.shards: list[Shard | None] = [None] * n
        self.valid = 0
        self.pending = n
        self.missing: set[int] = set()
        self.corrupt: set[int] = set()
        self.errors: dict[int, str] = {}
        self.cond = threading.Condition()

    def on_reply(self, index: int, fut: Future[Shard]) -> None:
        exc = fut.exception() if not fut.cancelled() else NodeError("?", "cancelled")
        with self.cond:
            self.pending -= 1
            if exc is None:
                shard = fut.result()
                try:
                    ok = index in self.codec.valid(self._one(index, shard), self.object_id)
                except Exception:  # noqa: BLE001 - any malformed shard is just a bad shard
                    ok = False
                if ok:
                    self.shards[index] = shard
                    self.valid += 1
                else:
                    self.corrupt.add(index)
                    self.errors[index] = "failed checksum at the client"
            else:
                self.errors[index] = str(exc)
                if isinstance(exc, ShardMissing):
                    self.missing.add(index)
                elif isinstance(exc, ShardCorruptOnNode):
                    self.corrupt.add(index)
            self.cond.notify_all()

    def _one(self, index: int, shard: Shard) -> list[Shard | None]:
        one: list[Shard | None] = [None] * len(self.shards)
        one[index] = shard
        return one

    def ready(self) -> bool:
        return self.valid >= self.k or self.pending == 0 or len(self.missing) > self.m


def read_object(
    pool: Executor,
    codec: Codec,
    transports: Sequence[ShardTransport],
    object_id: bytes,
    timeout_s: float,
    on_settled: Callable[[set[int]], None] | None = None,
) -> bytes:
    """Decode one object from the first k valid shards of its group.

    Raises ObjectLost when more than m live nodes report the shard gone, ObjectUnavailable
    when fewer than k valid shards arrive within ``timeout_s``. ``on_settled`` is called
    (from a pool thread) once every reply is in, with the indices that were missing or
    corrupt on a live node; stragglers are not cancelled so that they can report.
    """
    n = len(transports)
    gather = _Gather(codec, object_id, n)
    cancel = Cancel()
    deadline = time.monotonic() + timeout_s
    settled = threading.Event()

    def finish(index: int, fut: Future[Shard]) -> None:
        gather.on_reply(index, fut)
        with gather.cond:
            last = gather.pending == 0
        if last:
            settled.set()
            if on_settled is not None and (gather.missing or gather.corrupt):
                on_settled(gather.missing | gather.corrupt)

    for i, t in enumerate(transports):
        fut = pool.submit(t.get_shard, object_id, i, timeout_s, cancel)
        fut.add_done_callback(functools.partial(finish, i))
    with gather.cond:
        while not gather.ready():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            gather.cond.wait(left)
        shards, valid, missing = list(gather.shards), gather.valid, set(gather.missing)
        errors = dict(gather.errors)
    if valid >= codec.config.k:
        return codec.decode(shards, object_id)
    cancel.cancel()
    detail = "; ".join(f"shard {i} {e}" for i, e in sorted(errors.items())) or "no replies in time"
    if len(missing) > codec.config.m:
        raise ObjectLost(f"object {object_id.hex()}: {len(missing)} shards gone ({detail})")
    raise ObjectUnavailable(
        f"object {object_id.hex()}: {TooFewShards(valid, codec.config.k)} within {timeout_s:.2f}s ({detail})"
    )
