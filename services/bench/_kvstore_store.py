"""Store part of ``sluice bench kvstore``: put/get GB/s through real nodes against Redis
SET/GET of the same payloads, degraded reads, and single-block latency.

Every get figure is the best of its timed rounds, and the rounds are interleaved: a store
get of one size, a Redis get of the same size, then the next size. They run in cycles of
healthy rounds, then 2 nodes killed and degraded rounds, then the 2 restarted. On a shared
machine a slow moment then lands on both sides of a ratio instead of on whichever side
happened to be measured in it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KILLED = (0, 1)  # node indices killed for the degraded rounds


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class _Size:
    """One object size: its payloads, the store's keys for them and the best times seen."""

    size: int
    payloads: list[bytes]
    keys: list[bytes] = field(default_factory=list)
    redis_keys: list[str] = field(default_factory=list)
    objects: int = 0
    best: dict[str, float] = field(default_factory=dict)  # figure -> best seconds
    first_get_s: float = 0.0  # the first store read, with the nodes' hot caches cold

    @property
    def nbytes(self) -> int:
        return self.size * len(self.payloads)

    def note(self, figure: str, seconds: float) -> None:
        self.best[figure] = min(self.best.get(figure, float("inf")), seconds)

    def rate(self, figure: str) -> float:
        return self.nbytes / self.best[figure] / 1e9


class _Redis:
    """SET/GET of each size's payloads through one connection, one pipeline per batch."""

    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def put(self, s: _Size) -> None:
        s.redis_keys = [f"bench:{s.size}:{i}" for i in range(len(s.payloads))]
        pipe = self.r.pipeline(transaction=False)
        for k, v in zip(s.redis_keys, s.payloads):
            pipe.set(k, v)
        pipe.execute()

    def get(self, s: _Size) -> list[bytes]:
        pipe = self.r.pipeline(transaction=False)
        for k in s.redis_keys:
            pipe.get(k)
        return list(pipe.execute())

    def close(self) -> None:
        self.r.close()


def _puts(client: Any, redis: _Redis, s: _Size, rounds: int) -> None:
    for _ in range(rounds):  # every round writes fresh blocks (put_blocks skips cached ones)
        keys = [os.urandom(32) for _ in s.payloads]
        start = time.perf_counter()
        metas = client.put_blocks(keys, s.payloads, "chat")
        s.note("put", time.perf_counter() - start)
        s.keys, s.objects = keys, len({m.object_id for m in metas})
        s.note("redis_put", _timed(lambda: redis.put(s)))


def _gets(client: Any, redis: _Redis, sizes: list[_Size], rounds: int, figure: str) -> None:
    """``rounds`` interleaved rounds; the bytes of the last round are checked on both sides."""
    for _ in range(rounds):
        for s in sizes:
            s.note(figure, _timed(lambda s=s: client.get_prefix(s.keys)))  # type: ignore[misc]
            s.note("redis_get", _timed(lambda s=s: redis.get(s)))  # type: ignore[misc]
            if s.first_get_s == 0.0:
                s.first_get_s = s.best[figure]
    for s in sizes:  # the last round of each size, checked outside the timing
        if client.get_prefix(s.keys, touch=False) != s.payloads or redis.get(s) != s.payloads:
            raise RuntimeError(f"wrong bytes read back for {s.size}-byte objects")


def _latency(client: Any, size: int, samples: int) -> dict[str, float]:
    keys = [os.urandom(32) for _ in range(min(samples, 64))]
    client.put_blocks(keys, [os.urandom(size) for _ in keys], "chat")
    lat = sorted(_timed(lambda i=i: client.get_prefix([keys[i % len(keys)]])) for i in range(samples))  # type: ignore[misc]
    return {
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "samples": samples,
    }


def run_store(
    client: Any,
    cluster: Any,
    redis_url: str,
    sizes: list[int],
    args: Any,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """{"store": {size: {...}}, "degraded": {size: {...}}, "latency": {...}}."""
    redis = _Redis(redis_url)
    rows = [
        _Size(size, [os.urandom(size) for _ in range(max(4, args.bytes_per_size // size))]) for size in sizes
    ]
    try:
        for s in rows:
            log(f"put {s.size >> 10} KiB x {len(s.payloads)}: store and redis, {args.rounds} rounds")
            _puts(client, redis, s, args.rounds)
        latency: dict[str, float] = {}
        for cycle in range(args.cycles):
            log(f"cycle {cycle + 1}/{args.cycles}: healthy gets, {args.rounds} interleaved rounds")
            _gets(client, redis, rows, args.rounds, "get")
            if cycle == 0:
                log(f"latency: {args.latency_samples} single-block reads of {args.latency_size >> 10} KiB")
                latency = _latency(client, args.latency_size, args.latency_samples)
            for i in KILLED:
                cluster.kill(i)
            log(f"cycle {cycle + 1}/{args.cycles}: nodes {KILLED} killed, degraded gets")
            _gets(client, redis, rows, args.rounds, "degraded")
            for i in KILLED:
                cluster.restart(i)
            client.health_check(5.0)  # the restarted nodes take their shards back at once
        for s in rows:
            log(f"  {s.size >> 10} KiB: store get {s.rate('get'):.3f} degraded {s.rate('degraded'):.3f} "
                f"redis get {s.rate('redis_get'):.3f} GB/s")  # fmt: skip
    finally:
        redis.close()
    return {
        "store": {
            str(s.size): {
                "store": {
                    "put_GBps": s.rate("put"),
                    "get_GBps": s.rate("get"),
                    "get_first_round_GBps": s.nbytes / s.first_get_s / 1e9,
                    "objects": s.objects,  # erasure-coded objects the blocks became
                },
                "redis": {"put_GBps": s.rate("redis_put"), "get_GBps": s.rate("redis_get")},
                "count": len(s.payloads),
            }
            for s in rows
        },
        "degraded": {
            str(s.size): {"get_GBps": s.rate("degraded"), "ratio": s.rate("degraded") / s.rate("get")}
            for s in rows
        },
        "latency": latency,
    }
