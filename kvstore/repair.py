"""Background repair: rewrite the shards of an object that are missing or corrupt.

Reads and short writes enqueue a block; the worker reads every shard of the committed
object, rebuilds the bad ones from any k valid ones and puts them back on their nodes,
then records the new shard mask in the directory (only if the entry still names the same
object). No gRPC here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import wait
from typing import TYPE_CHECKING

from kvstore.codec import TooFewShards
from kvstore.shardfmt import Shard
from kvstore.transport import NodeError

if TYPE_CHECKING:
    from kvstore.client import StoreClient

log = logging.getLogger(__name__)


class RepairWorker:
    def __init__(self, client: StoreClient, background: bool = True, max_queue: int = 100_000) -> None:
        self._client = client
        self._pending: dict[bytes, None] = {}
        self._cond = threading.Condition()
        self._stop = False
        self.max_queue = max_queue
        self.repaired_shards = 0
        self.failed = 0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="kv-repair", daemon=True)
            self._thread.start()

    def enqueue(self, key: bytes) -> None:
        with self._cond:
            if len(self._pending) < self.max_queue:
                self._pending[key] = None
                self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _take(self) -> bytes | None:
        with self._cond:
            if not self._pending:
                return None
            key = next(iter(self._pending))
            del self._pending[key]
            return key

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            key = self._take()
            if key is not None:
                self._repair_logged(key)

    def _repair_logged(self, key: bytes) -> int:
        try:
            return self.repair_key(key)
        except Exception as exc:  # noqa: BLE001 - the worker must outlive any one block
            self.failed += 1
            log.warning("repair of block %s failed: %s", key.hex()[:16], exc)
            return 0

    def run_pending(self) -> int:
        """Repair everything queued now, in the calling thread; returns shards rewritten."""
        total = 0
        while (key := self._take()) is not None:
            total += self._repair_logged(key)
        return total

    def repair_key(self, key: bytes) -> int:
        """Rewrite the missing or corrupt shards of ``key``'s object; returns how many."""
        c = self._client
        meta = c.directory.get(key)
        if meta is None:
            return 0
        transports = [c.transports[n] for n in meta.nodes]
        shards = self._read_all(transports, meta.object_id)
        good = c.codec.valid(shards, meta.object_id)
        if len(good) == len(shards):
            c.directory.set_present(key, meta.object_id, (1 << len(shards)) - 1)
            return 0
        if len(good) < c.codec.config.k:
            raise TooFewShards(len(good), c.codec.config.k, f"block {key.hex()[:16]} cannot be repaired now")
        full = c.codec.reconstruct(shards, meta.object_id)
        mask = sum(1 << i for i in good)
        for i in range(len(full)):
            if i in good:
                continue
            try:
                transports[i].put_shard(full[i], c.config.write_timeout_s)
            except NodeError as exc:
                log.info("repair: shard %d of %s not rewritten: %s", i, key.hex()[:16], exc)
                continue
            mask |= 1 << i
            self.repaired_shards += 1
        c.directory.set_present(key, meta.object_id, mask)
        return bin(mask).count("1") - len(good)

    def _read_all(self, transports: Sequence, object_id: bytes) -> list[Shard | None]:
        c = self._client
        futs = [
            c._shard_pool.submit(t.get_shard, object_id, i, c.config.read_timeout_s)
            for i, t in enumerate(transports)
        ]
        wait(futs, timeout=c.config.read_timeout_s + 1.0)
        return [f.result() if f.done() and f.exception() is None else None for f in futs]

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
