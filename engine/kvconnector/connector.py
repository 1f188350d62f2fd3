"""The KV connector's store side: asynchronous prefix fetches and a bounded write-through queue.

The engine core drives it from its own thread and never waits on the network:

- ``fetch(hashes)`` starts the store's fan-out read of the longest cached run (the store
  client's ``get_prefix_async``) and returns a ``PendingFetch``. The core polls ``done()``
  between steps and calls ``result()``, which verifies each payload (format version, model
  fingerprint, layout, checksum) and keeps the run up to the first bad one. A store that
  cannot answer (3 or more nodes down, Redis gone) or a fetch past its deadline gives an
  empty run: the request recomputes, correctly, and a counter and the log say so.
- ``save(items)`` queues snapshots of newly published blocks for the store. The queue is
  bounded in bytes; when the store is slower than the engine, blocks are dropped (counted),
  never the step. A worker thread writes them in batches, one ``put_blocks`` per traffic
  class, deduplicated by hash against the blocks this engine already knows the store holds.

No torch here: payloads are bytes, verified by ``engine.kvconnector.payload``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SaveItem = tuple[bytes, bytes, str]  # (block hash, payload, traffic class)


@dataclass(frozen=True)
class _Drop:
    """A write-queue entry: delete this block from the store (it failed verification)."""

    block: bytes


_NOTHING = _Drop(b"")  # the write loop's "no pending entry" marker (never queued)


@dataclass(frozen=True)
class ConnectorConfig:
    # Write-through queue bound. Principle: one full batched put of the store client
    # (``StoreClientConfig.batch_bytes``, 64 MiB) may wait while another is in flight; more
    # than that means the store is slower than the engine and waiting would only add memory.
    save_queue_bytes: int = 64 << 20
    save_batch_blocks: int = 256  # blocks drained per put round
    # A fetch not answered by then is abandoned and the request recomputes. Principle: the
    # store's own read timeout; a read slower than that is a failing store, not a slow hit.
    fetch_deadline_s: float = 2.5
    known_hashes: int = 1 << 16  # hashes remembered as stored (dedupe before the directory)
    # Hashes of blocks seen in the store (written or fetched) kept for a router to drain
    # (``take_stored``); past this many the oldest are dropped (a router's hint, not a record).
    stored_events: int = 1 << 16

    def __post_init__(self) -> None:
        if self.save_queue_bytes < 1 or self.save_batch_blocks < 1 or self.known_hashes < 1:
            raise ValueError("save_queue_bytes, save_batch_blocks and known_hashes must be >= 1")
        if self.fetch_deadline_s <= 0:
            raise ValueError(f"fetch_deadline_s must be > 0 seconds, got {self.fetch_deadline_s}")


@dataclass
class ConnectorStats:
    fetches: int = 0
    fetched_blocks: int = 0  # verified blocks handed to the engine
    fetch_failures: int = 0  # store errors and deadlines: recomputed
    corrupt_blocks: int = 0  # payloads refused by the verifier: recomputed
    saved_blocks: int = 0
    save_failures: int = 0  # blocks whose put failed
    dropped_blocks: int = 0  # not queued: the queue was full
    deduplicated_blocks: int = 0
    queued_bytes: int = 0
    fetch_s_per_block: float = 0.0  # running mean of answered fetches (0 before the first)

    def as_dict(self) -> dict[str, float]:
        return {f"kv_store_{k}": float(v) for k, v in self.__dict__.items()}


@dataclass
class PendingFetch:
    """One request's fetch in flight: the store's future and when it is given up."""

    hashes: tuple[bytes, ...]
    future: Future[Any]
    deadline: float
    _connector: StoreConnector = field(repr=False)
    started: float = 0.0

    def done(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def result(self) -> list[bytes]:
        """The verified payloads of the longest good run (possibly empty). Never raises."""
        return self._connector._settle(self)


class StoreConnector:
    """``client``: a ``kvstore.client.StoreClient``; ``verify(payload)`` raises ValueError
    (``PayloadError``) for a payload this engine must not use."""

    def __init__(
        self, client: Any, verify: Callable[[bytes], None], config: ConnectorConfig | None = None
    ) -> None:
        self.client = client
        self.verify = verify
        self.config = config or ConnectorConfig()
        self.stats = ConnectorStats()
        self._lock = threading.Lock()  # stats and the known-hash LRU (both threads)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._queue: queue.Queue[SaveItem | _Drop | None] = queue.Queue()
        self._stored: deque[bytes] = deque(maxlen=self.config.stored_events)
        self._fetch_time = (0.0, 0)  # seconds and blocks of answered fetches
        self._worker = threading.Thread(target=self._write_loop, name="sluice-kv-save", daemon=True)
        self._worker.start()

    # -- reads ---------------------------------------------------------------------------
    def fetch(self, hashes: Sequence[bytes]) -> PendingFetch:
        self.stats.fetches += 1
        fut = self.client.get_prefix_async(list(hashes))
        now = time.monotonic()
        return PendingFetch(tuple(hashes), fut, now + self.config.fetch_deadline_s, self, now)

    def _settle(self, p: PendingFetch) -> list[bytes]:
        if not p.future.done():
            p.future.cancel()
            self._fetch_failed(f"no answer within {self.config.fetch_deadline_s:.1f} s")
            return []
        try:
            views = p.future.result()
        except Exception as exc:  # noqa: BLE001 - any store failure means recompute
            self._fetch_failed(f"{type(exc).__name__}: {exc}")
            return []
        if views:
            self._time_fetch(time.monotonic() - p.started, len(views))
        good: list[bytes] = []
        for h, view in zip(p.hashes, views):
            payload = bytes(view)
            try:
                self.verify(payload)
            except ValueError as exc:
                with self._lock:
                    self.stats.corrupt_blocks += 1
                log.warning("store block %s refused (%s); recomputing from there", h.hex()[:12], exc)
                self._drop_corrupt(h)
                break
            good.append(payload)
            self._remember([h])
        with self._lock:
            self.stats.fetched_blocks += len(good)
        return good

    def _time_fetch(self, seconds: float, blocks: int) -> None:
        """Fetch seconds per block, over every answered fetch: what a router charges a store hit."""
        with self._lock:
            total_s, total_blocks = self._fetch_time
            self._fetch_time = (total_s + seconds, total_blocks + blocks)
            self.stats.fetch_s_per_block = self._fetch_time[0] / self._fetch_time[1]

    def take_stored(self) -> list[bytes]:
        """Hashes seen in the store since the last call (thread-safe; for a router's index)."""
        with self._lock:
            out = list(self._stored)
            self._stored.clear()
        return out

    def _drop_corrupt(self, h: bytes) -> None:
        """Delete a refused block from the store so that the engine's write-through of the
        recomputed block replaces it (the write skips hashes the directory still names):
        heal on read, instead of every engine refusing it until its TTL ends. The delete
        goes through the write queue, so it lands before that write."""
        self._queue.put(_Drop(h))

    def _fetch_failed(self, why: str) -> None:
        with self._lock:
            self.stats.fetch_failures += 1
        log.warning("KV store read failed (%s); the request recomputes its prefix", why)

    # -- writes --------------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether a snapshot is worth taking now (the queue is below its byte bound)."""
        return self.stats.queued_bytes < self.config.save_queue_bytes

    def is_known(self, h: bytes) -> bool:
        with self._lock:
            return h in self._known

    def save(self, items: Sequence[SaveItem]) -> None:
        """Queue blocks for the store; never blocks. Known hashes are skipped, and items past
        the byte bound are dropped and counted."""
        for h, payload, cls in items:
            with self._lock:
                if h in self._known:
                    self.stats.deduplicated_blocks += 1
                    continue
                if self.stats.queued_bytes + len(payload) > self.config.save_queue_bytes:
                    self.stats.dropped_blocks += 1
                    continue
                self.stats.queued_bytes += len(payload)
            self._queue.put((h, payload, cls))

    def count_dropped(self, n: int) -> None:
        with self._lock:
            self.stats.dropped_blocks += n

    def _write_loop(self) -> None:
        """One writer, in queue order: batches of saves, and deletes where they were queued."""
        while True:
            item = self._queue.get()
            batch: list[SaveItem] = []
            while item is not None and not isinstance(item, _Drop):
                batch.append(item)
                if len(batch) >= self.config.save_batch_blocks:
                    item = _NOTHING
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = _NOTHING
                    break
            if batch:
                self._write(batch)
            if item is None:
                return
            if isinstance(item, _Drop) and item is not _NOTHING:
                self._delete(item.block)

    def _delete(self, h: bytes) -> None:
        try:
            self.client.delete([h])
        except Exception as exc:  # noqa: BLE001 - a failed delete leaves only a refusal
            log.warning("deleting refused block %s from the store failed: %s", h.hex()[:12], exc)

    def _write(self, batch: list[SaveItem]) -> None:
        by_class: dict[str, list[SaveItem]] = {}
        for item in batch:
            by_class.setdefault(item[2], []).append(item)
        for cls, items in by_class.items():
            hashes = [h for h, _, _ in items]
            try:
                self.client.put_blocks(hashes, [p for _, p, _ in items], cls)
            except Exception as exc:  # noqa: BLE001 - a failed write only loses a future hit
                with self._lock:
                    self.stats.save_failures += len(items)
                log.warning("KV store write of %d blocks failed: %s", len(items), exc)
            else:
                with self._lock:
                    self.stats.saved_blocks += len(items)
                self._remember(hashes)
            finally:
                with self._lock:
                    self.stats.queued_bytes -= sum(len(p) for _, p, _ in items)

    def _remember(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            self._stored.extend(hashes)
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > self.config.known_hashes:
                self._known.popitem(last=False)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block was written or failed (tests, shutdown)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if self.stats.queued_bytes == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=30.0)
        self.client.close()
