"""One engine's part in sharing sliding-window slots with the others.

With ``EngineConfig.swa_directory`` set, an engine
- serves the slots of its host slot pool over gRPC (``SlotServer``, on a free port);
- publishes each slot it saves in the SWA directory and withdraws each one its pool evicts,
  from a background thread (directory calls never run on the step path);
- renews its lease there every third of ``lease_s``: when it dies, its entries stop being
  returned within ``lease_s``;
- on a new request, finds in the directory a slot of another engine that the request's
  tokens extend further than any slot it holds itself, and fetches it into its own pool,
  where admission finds it like a local one; lookup and fetch run on a worker thread while
  the request waits (one directory round trip when there is nothing to fetch). A fetch that fails (the holder died,
  evicted it, or sent bytes that do not verify) costs a replay, never a wrong answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.kvconnector import payload as fmt
from engine.kvconnector.slot_server import SlotServer, fetch_slot
from engine.kvconnector.swa_directory import SlotLocation, open_slot_directory
from engine.scheduler.hashing import ROOT_HASH
from engine.scheduler.host_slots import HostSlot, HostSlotPool

log = logging.getLogger(__name__)


class SlotSharing:
    def __init__(
        self,
        pool: HostSlotPool,
        directory_url: str,
        kv: Any,
        host: str = "127.0.0.1",
        lease_s: float = 10.0,
        fetch_timeout_s: float = 5.0,
    ) -> None:
        self.pool = pool
        self.directory = open_slot_directory(directory_url)
        self.server = SlotServer(pool, host)
        self.holder = self.server.address
        self.lease_s, self.fetch_timeout_s = lease_s, fetch_timeout_s
        self._kv = kv  # engine.kvconnector.worker.KVWorker: this engine's identity and layout
        self.fetches = self.fetched = self.fetch_failures = self.fetched_bytes = 0
        self._changes: queue.Queue[tuple[str, HostSlot] | None] = queue.Queue()
        self.directory.heartbeat(self.holder, lease_s)  # live before the first entry
        pool.on_change = lambda kind, entry: self._changes.put((kind, entry))
        self._thread = threading.Thread(target=self._run, name="swa-directory", daemon=True)
        self._thread.start()
        self._fetcher = ThreadPoolExecutor(2, thread_name_prefix="swa-fetch")

    # -- the directory thread ----------------------------------------------------------------
    def _run(self) -> None:
        beat_every = self.lease_s / 3
        next_beat = time.monotonic() + beat_every
        while True:
            try:
                item = self._changes.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = ("beat", None)  # type: ignore[assignment]
            if item is None:
                return
            try:
                kind, entry = item
                if kind == "put":
                    self.directory.publish(self.holder, entry.anchor, entry.tail)
                elif kind == "drop":
                    self.directory.withdraw(self.holder, entry.anchor, entry.tail)
                if time.monotonic() >= next_beat:
                    self.directory.heartbeat(self.holder, self.lease_s)
                    next_beat = time.monotonic() + beat_every
            except Exception:  # the directory is down: serve on; entries return with it
                log.warning("SWA directory unreachable; slots are not shared meanwhile", exc_info=True)

    # -- the fetching side -------------------------------------------------------------------
    def find(
        self,
        anchors: Sequence[bytes],
        tokens: Sequence[int],
        block_size: int,
        max_tokens: int,
        better_than: int,
    ) -> tuple[SlotLocation, int] | None:
        """The longest slot of another engine that ``tokens`` extend, longer than
        ``better_than`` tokens: (where, its position); None if there is none or the
        directory cannot be read."""
        try:
            found = self.directory.locate(anchors)
        except Exception:
            log.warning("SWA directory unreachable; replaying instead", exc_info=True)
            return None
        index = {a: k for k, a in enumerate(anchors)}
        best: tuple[SlotLocation, int] | None = None
        for loc in found:
            start = index[loc.anchor] * block_size
            n = start + len(loc.tail)
            if loc.holder == self.holder or n > max_tokens or n <= (best[1] if best else better_than):
                continue
            if len(loc.tail) < block_size and tuple(tokens[start:n]) == loc.tail:
                best = (loc, n)
        return best

    def start_fetch(
        self, tokens: Sequence[int], hashes: Sequence[bytes], block_size: int
    ) -> Future[HostSlot | None]:
        """In the background (the directory lookup too: it never runs on the step path): the
        longest peer slot that ``tokens`` (whose full blocks hash to ``hashes``) extend
        further than any slot this engine holds, fetched into this engine's pool; the
        future's result is the entry, or None when there is none or the fetch failed."""
        return self._fetcher.submit(self._find_and_fetch, tuple(tokens), [ROOT_HASH, *hashes], block_size)

    def _find_and_fetch(
        self, tokens: tuple[int, ...], anchors: list[bytes], block_size: int
    ) -> HostSlot | None:
        max_hit = len(tokens) - 1
        mine = self.pool.match(anchors, tokens, block_size, max_hit)
        found = self.find(anchors, tokens, block_size, max_hit, mine.num_tokens if mine is not None else 0)
        return self._fetch(*found) if found is not None else None

    def _check(self, entry: HostSlot) -> None:
        """A peer's slot is this engine's model, layout, dtype, host format and kept layers; ValueError if not."""
        kv = self._kv
        meta = fmt.decode(
            entry.slot_payload,
            kind=fmt.KIND_SLOT,
            fingerprint=kv.fingerprint,
            digest=kv.digest,
            dtype=kv.dtype,
        ).meta
        if meta.get("format", "native") != self.pool.format:
            raise ValueError(f"a {meta.get('format', 'native')} slot for a {self.pool.format} host pool")
        if meta.get("layers") != self.pool.layers:
            raise ValueError(f"a slot of {meta.get('layers')} layers for a host pool of {self.pool.layers}")
        if entry.tail_payload is not None:
            kv.verify_block(entry.tail_payload)

    def _fetch(self, loc: SlotLocation, num_tokens: int) -> HostSlot | None:
        self.fetches += 1
        entry = fetch_slot(loc.holder, loc.anchor, loc.tail, num_tokens, self._check, self.fetch_timeout_s)
        if entry is None or not self.pool.put(entry):
            self.fetch_failures += 1
            return None
        self.fetched += 1
        self.fetched_bytes += entry.nbytes
        return entry

    def stats(self) -> dict[str, float]:
        return {
            "swa_slot_fetches": float(self.fetches),
            "swa_slot_fetched": float(self.fetched),
            "swa_slot_fetch_failures": float(self.fetch_failures),
            "swa_slot_fetched_bytes": float(self.fetched_bytes),
            "swa_slots_served": float(self.server.served),
            "swa_slot_served_bytes": float(self.server.served_bytes),
        }

    def close(self) -> None:
        self._changes.put(None)
        self._thread.join(timeout=5)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        try:
            self.directory.leave(self.holder)
        except Exception:
            log.warning("could not withdraw this engine's slots from the SWA directory", exc_info=True)
        self.server.stop()
        self.directory.close()
