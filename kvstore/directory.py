"""The block directory: block hash -> the object that holds its bytes, and where.

One interface (``Directory``), two backends: ``InMemoryDirectory`` (embedded default,
this module) and ``RedisDirectory`` (``kvstore.redis_directory``). The directory holds
metadata only; shard bytes never pass through it. An entry becomes visible only when
``commit`` is called after enough shards are durable, which is what makes a write whole
or absent. Pure: no sockets here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

MAX_CHAIN = 4096  # longest hash chain one lookup accepts


@dataclass(frozen=True)
class BlockMeta:
    """Where one block's object lives. ``present`` is a bitmask of shard indices on disk.

    A block of a group (``length`` not None) is ``length`` bytes at ``offset`` of an object
    that holds several blocks; an ungrouped block (``length`` None, rows written before
    groups existed too) is the whole object."""

    key: bytes  # block hash
    object_id: bytes  # 16 bytes, one per write
    nodes: tuple[str, ...]  # node id holding shard i
    size: int  # object bytes
    traffic_class: str
    present: int
    last_access_ms: int
    offset: int = 0
    length: int | None = None

    @property
    def grouped(self) -> bool:
        return self.length is not None

    def span(self) -> tuple[int, int]:
        """``(start, end)`` of the block's bytes in its object."""
        end = self.size if self.length is None else self.offset + self.length
        return self.offset, end

    def missing(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if not self.present >> i & 1]


def check_chain(keys: Sequence[bytes]) -> None:
    if len(keys) > MAX_CHAIN:
        raise ValueError(f"hash chain of {len(keys)} blocks exceeds the limit of {MAX_CHAIN}")


class Directory(Protocol):
    """Block metadata with per-entry TTL.

    Contract: ``commit`` makes an entry visible atomically (all fields at once) and sets its
    TTL; it replaces an older entry for the same key. ``commit_many`` does the same for many
    entries in one round trip (each entry atomic on its own). ``lookup_prefix`` returns the entries
    of the longest run of ``keys`` from the first one that are all present, in one round
    trip, and changes nothing; ``lookup_many`` returns one entry (or None) per key, also in
    one round trip. ``touch`` refreshes last access and TTL of existing entries.
    ``set_present`` updates the shard mask only if the entry still names ``object_id``
    (a concurrent rewrite wins). ``delete`` removes entries. None of them raise for absent
    keys; backends raise their own connection errors.

    Groups: ``commit_many`` also sets, for every object that grouped rows of the call name,
    a count of the rows pointing at it, with the same TTL (``touch`` refreshes it with its
    rows). ``release`` removes rows like ``delete`` and, atomically with that, decrements
    those counts; it returns the number of rows removed and one row per object that no row
    points at anymore (every ungrouped row removed, and a grouped row whose count reached
    zero), so the caller can delete that object's shards.
    """

    def commit(self, meta: BlockMeta, ttl_s: float) -> None: ...

    def commit_many(self, items: Sequence[tuple[BlockMeta, float]]) -> None: ...

    def get(self, key: bytes) -> BlockMeta | None: ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[BlockMeta]: ...

    def lookup_many(self, keys: Sequence[bytes]) -> list[BlockMeta | None]: ...

    def touch(self, keys: Sequence[bytes], ttl_s: Mapping[str, float]) -> int: ...

    def set_present(self, key: bytes, object_id: bytes, present: int) -> bool: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def release(self, keys: Sequence[bytes]) -> tuple[int, list[BlockMeta]]: ...

    def close(self) -> None: ...


class InMemoryDirectory:
    """The embedded directory: a dict with expiry times, safe across threads."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[bytes, tuple[BlockMeta, float]] = {}
        self._refs: dict[bytes, list[float]] = {}  # grouped object id -> [rows, expiry]
        self._lock = threading.Lock()

    def _live(self, key: bytes, now: float) -> BlockMeta | None:
        item = self._entries.get(key)
        if item is None:
            return None
        if item[1] <= now:
            del self._entries[key]
            return None
        return item[0]

    def commit(self, meta: BlockMeta, ttl_s: float) -> None:
        with self._lock:
            self._entries[meta.key] = (meta, self._clock() + ttl_s)

    def commit_many(self, items: Sequence[tuple[BlockMeta, float]]) -> None:
        with self._lock:
            now = self._clock()
            for meta, ttl_s in items:
                self._entries[meta.key] = (meta, now + ttl_s)
            for oid, (rows, ttl_s) in group_counts(items).items():
                self._refs[oid] = [rows, now + ttl_s]

    def get(self, key: bytes) -> BlockMeta | None:
        with self._lock:
            return self._live(key, self._clock())

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[BlockMeta]:
        check_chain(keys)
        out = []
        with self._lock:
            now = self._clock()
            for key in keys:
                meta = self._live(key, now)
                if meta is None:
                    break
                out.append(meta)
        return out

    def lookup_many(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        check_chain(keys)
        with self._lock:
            now = self._clock()
            return [self._live(k, now) for k in keys]

    def touch(self, keys: Sequence[bytes], ttl_s: Mapping[str, float]) -> int:
        count = 0
        with self._lock:
            now = self._clock()
            for key in keys:
                meta = self._live(key, now)
                if meta is None:
                    continue
                fresh = replace(meta, last_access_ms=int(now * 1000))
                self._entries[key] = (fresh, now + ttl_s[meta.traffic_class])
                ref = self._refs.get(meta.object_id)
                if meta.grouped and ref is not None:
                    ref[1] = now + ttl_s[meta.traffic_class]
                count += 1
        return count

    def set_present(self, key: bytes, object_id: bytes, present: int) -> bool:
        with self._lock:
            item = self._entries.get(key)
            if item is None or item[0].object_id != object_id:
                return False
            self._entries[key] = (replace(item[0], present=present), item[1])
            return True

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return sum(self._entries.pop(k, None) is not None for k in keys)

    def release(self, keys: Sequence[bytes]) -> tuple[int, list[BlockMeta]]:
        removed, free = 0, []
        with self._lock:
            now = self._clock()
            for key in keys:
                meta = self._live(key, now)
                if meta is None:
                    continue
                del self._entries[key]
                removed += 1
                if not meta.grouped:
                    free.append(meta)
                    continue
                ref = self._refs.get(meta.object_id)
                if ref is None or ref[1] <= now or ref[0] <= 1:  # like DECR of an absent key
                    self._refs.pop(meta.object_id, None)
                    free.append(meta)
                else:
                    ref[0] -= 1
        return removed, free

    def close(self) -> None:
        pass


def group_counts(items: Sequence[tuple[BlockMeta, float]]) -> dict[bytes, tuple[int, float]]:
    """Object id -> (grouped rows in ``items`` naming it, the longest TTL among them)."""
    out: dict[bytes, tuple[int, float]] = {}
    for meta, ttl_s in items:
        if meta.grouped:
            rows, ttl = out.get(meta.object_id, (0, 0.0))
            out[meta.object_id] = (rows + 1, max(ttl, ttl_s))
    return out


def _conforms(d: InMemoryDirectory) -> Directory:
    return d  # mypy checks that InMemoryDirectory implements the Directory protocol
