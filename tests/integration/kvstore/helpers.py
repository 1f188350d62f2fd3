"""Shared steps of the store integration tests (cluster surgery and load)."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.client import StoreClient, WriteFailed
from kvstore.cluster import LocalStoreCluster
from kvstore.directory import BlockMeta
from kvstore.fanout import ObjectUnavailable


def node_index(node_id: str) -> int:
    return int(node_id[1:])


def shard_path(cluster: LocalStoreCluster, meta: BlockMeta, index: int) -> Path:
    name = f"{meta.object_id.hex()}.{index:02d}"
    return cluster.data_dir(node_index(meta.nodes[index])) / "shards" / name[:1] / name


@dataclass
class Load:
    """Writers and readers hammering the store while the test breaks nodes."""

    client: StoreClient
    seed: int = 0
    sizes: tuple[int, ...] = (1, 4095, 65_537, 300_001)
    written: dict[bytes, bytes] = field(default_factory=dict)
    write_failures: int = 0
    reads: int = 0
    wrong: list[str] = field(default_factory=list)
    unexpected: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _writer(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            key, data = rng.randbytes(32), os.urandom(rng.choice(self.sizes))
            try:
                self.client.put_object(key, data, "chat")
            except WriteFailed:
                with self._lock:
                    self.write_failures += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - reported by check()
                self.unexpected.append(exc)
                return
            with self._lock:
                self.written[key] = data

    def _reader(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            with self._lock:
                keys = list(self.written)
            if not keys:
                time.sleep(0.01)
                continue
            key = rng.choice(keys)
            try:
                got = self.client.get_prefix([key], touch=False)
            except BaseException as exc:  # noqa: BLE001
                self.unexpected.append(exc)
                return
            self.reads += 1
            if got != [self.written[key]]:
                self.wrong.append(key.hex())

    def run(self, during: float, action: object) -> None:
        threads = [
            threading.Thread(target=self._writer, args=(random.Random(self.seed * 7 + i),)) for i in range(2)
        ] + [
            threading.Thread(target=self._reader, args=(random.Random(self.seed * 11 + i),)) for i in range(2)
        ]
        for t in threads:
            t.start()
        try:
            self._wait(lambda: len(self.written) >= 3 and self.reads >= 1, during / 2)
            action()  # type: ignore[operator]
            reads = self.reads
            self._wait(lambda: self.reads >= reads + 3, during / 2)  # reads go on meanwhile
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=30)

    def _wait(self, cond: object, at_least_s: float, limit_s: float = 60.0) -> None:
        """Sleep ``at_least_s``, then until ``cond()`` holds (a slow machine still gets load)."""
        time.sleep(at_least_s)
        deadline = time.monotonic() + limit_s
        while not cond() and time.monotonic() < deadline and not self.unexpected:  # type: ignore[operator]
            time.sleep(0.01)

    def check_all_readable(self) -> None:
        for key, data in self.written.items():
            assert self.client.get_prefix([key], touch=False) == [data], key.hex()


def expect_unavailable_fast(client: StoreClient, keys: list[bytes]) -> float:
    start = time.monotonic()
    try:
        client.get_prefix(keys, touch=False)
    except ObjectUnavailable:
        return time.monotonic() - start
    raise AssertionError("read with 3 nodes down did not raise ObjectUnavailable")
