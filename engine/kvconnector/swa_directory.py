"""The SWA directory: which engine holds which sliding-window slot in its host slot pool.

Prefix blocks live in the shared KV store; a slot lives only in the host memory of the engine
that made it (``engine/scheduler/host_slots.py``). The directory lets another engine find it:
each entry names a slot by its key (the hash of its last full block, the anchor, plus the
tokens after it) and its holder (the address of the holder's slot server). A holder
publishes an entry when it saves a slot and withdraws it when its pool evicts the slot; a
holder that dies stops renewing its lease, and its entries stop being returned once the
lease runs out (the Redis backend also deletes them when a lookup meets them).

Two backends behind one interface, like the store's block directory: ``InMemorySlotDirectory``
(one process: tests, embedded engines) and ``RedisSlotDirectory`` (every engine of a
deployment). Redis schema, under a key prefix:

    {prefix}swa:a:{anchor hex}   hash: "{tail}|{holder}" -> holder (tail: token ids, comma-separated;
                                 several engines may hold the same slot)
    {prefix}swa:h:{holder}       the holder's lease: a key with a PX expiry, renewed by heartbeats
    {prefix}swa:held:{holder}    set of "{anchor hex}|{tail}" the holder published (for ``leave``)

Anchor hashes carry an expiry of ``ENTRY_TTL_S`` renewed on every publish, so entries of
holders that never come back are gone even if no lookup meets them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

ENTRY_TTL_S = 24 * 3600.0
MAX_HOLDER_CHARS = 256


@dataclass(frozen=True)
class SlotLocation:
    anchor: bytes
    tail: tuple[int, ...]
    holder: str  # host:port of the holder's slot server


class SlotDirectory(Protocol):
    def publish(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None: ...

    def withdraw(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None: ...

    def heartbeat(self, holder: str, lease_s: float) -> None:
        """``holder`` is alive for ``lease_s`` more seconds."""
        ...

    def locate(self, anchors: Sequence[bytes]) -> list[SlotLocation]:
        """Every entry under these anchors whose holder's lease is live."""
        ...

    def leave(self, holder: str) -> None:
        """Withdraw all of ``holder``'s entries and its lease (a clean shutdown)."""
        ...

    def close(self) -> None: ...


def _check_holder(holder: str) -> None:
    if not 0 < len(holder) <= MAX_HOLDER_CHARS or "|" in holder:
        raise ValueError(
            f"a holder is a non-empty address of at most {MAX_HOLDER_CHARS} characters, got {holder!r}"
        )


def _tail_text(tail: Sequence[int]) -> str:
    return ",".join(str(int(t)) for t in tail)


def _tail_of(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",")) if text else ()


class InMemorySlotDirectory:
    """The directory in one process's memory (thread-safe); ``clock`` for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, set[tuple[tuple[int, ...], str]]] = {}  # anchor -> (tail, holder)
        self._leases: dict[str, float] = {}

    def publish(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None:
        _check_holder(holder)
        with self._lock:
            self._entries.setdefault(bytes(anchor), set()).add((tuple(tail), holder))

    def withdraw(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None:
        with self._lock:
            self._entries.get(bytes(anchor), set()).discard((tuple(tail), holder))

    def heartbeat(self, holder: str, lease_s: float) -> None:
        _check_holder(holder)
        with self._lock:
            self._leases[holder] = self._clock() + lease_s

    def locate(self, anchors: Sequence[bytes]) -> list[SlotLocation]:
        now = self._clock()
        with self._lock:
            return [
                SlotLocation(a, tail, holder)
                for a in dict.fromkeys(bytes(x) for x in anchors)
                for tail, holder in sorted(self._entries.get(a, ()))
                if self._leases.get(holder, 0.0) > now
            ]

    def leave(self, holder: str) -> None:
        with self._lock:
            self._leases.pop(holder, None)
            for held in self._entries.values():
                held.difference_update([e for e in held if e[1] == holder])

    def close(self) -> None:
        pass


class RedisSlotDirectory:
    def __init__(self, url: str, prefix: str = "sluice:") -> None:
        import redis

        self._r = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self._p = prefix

    def _anchor_key(self, anchor: bytes) -> str:
        return f"{self._p}swa:a:{bytes(anchor).hex()}"

    def publish(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None:
        _check_holder(holder)
        key, text = self._anchor_key(anchor), _tail_text(tail)
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(key, f"{text}|{holder}", holder)
        pipe.pexpire(key, int(ENTRY_TTL_S * 1000))
        pipe.sadd(f"{self._p}swa:held:{holder}", f"{bytes(anchor).hex()}|{text}")
        pipe.pexpire(f"{self._p}swa:held:{holder}", int(ENTRY_TTL_S * 1000))
        pipe.execute()

    def withdraw(self, holder: str, anchor: bytes, tail: Sequence[int]) -> None:
        key, text = self._anchor_key(anchor), _tail_text(tail)
        pipe = self._r.pipeline(transaction=True)
        pipe.hdel(key, f"{text}|{holder}")
        pipe.srem(f"{self._p}swa:held:{holder}", f"{bytes(anchor).hex()}|{text}")
        pipe.execute()

    def heartbeat(self, holder: str, lease_s: float) -> None:
        _check_holder(holder)
        self._r.set(f"{self._p}swa:h:{holder}", b"1", px=max(1, int(lease_s * 1000)))

    def locate(self, anchors: Sequence[bytes]) -> list[SlotLocation]:
        keys = list(dict.fromkeys(bytes(a) for a in anchors))
        if not keys:
            return []
        pipe = self._r.pipeline(transaction=False)
        for a in keys:
            pipe.hgetall(self._anchor_key(a))
        rows = pipe.execute()
        found = [
            (a, field.decode().rsplit("|", 1)[0], h.decode())
            for a, row in zip(keys, rows)
            for field, h in row.items()
        ]
        holders = sorted({h for _, _, h in found})
        if not holders:
            return []
        alive = dict(zip(holders, self._r.mget([f"{self._p}swa:h:{h}" for h in holders])))
        dead = [(a, t, h) for a, t, h in found if alive[h] is None]
        if dead:  # a holder whose lease ran out: its entries go now
            pipe = self._r.pipeline(transaction=False)
            for a, t, h in dead:
                pipe.hdel(self._anchor_key(a), f"{t}|{h}")
            pipe.execute()
        return [SlotLocation(a, _tail_of(t), h) for a, t, h in found if alive[h] is not None]

    def leave(self, holder: str) -> None:
        held = f"{self._p}swa:held:{holder}"
        members: set[bytes] = self._r.smembers(held)  # type: ignore[assignment]
        pipe = self._r.pipeline(transaction=False)
        for m in members:
            anchor_hex, text = m.decode().split("|", 1)
            pipe.hdel(f"{self._p}swa:a:{anchor_hex}", f"{text}|{holder}")
        pipe.delete(held, f"{self._p}swa:h:{holder}")
        pipe.execute()

    def close(self) -> None:
        self._r.close()


def open_slot_directory(url: str) -> SlotDirectory:
    """``memory`` (this process only) or a Redis URL."""
    if url == "memory":
        return InMemorySlotDirectory()
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisSlotDirectory(url)
    raise ValueError(
        f"an SWA directory is 'memory' or a Redis URL such as redis://127.0.0.1:6379/0, got {url!r}"
    )
