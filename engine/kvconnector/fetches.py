"""The KV connector's scheduler side: the fetches a request waits for before admission.

With a store, a request whose prefix is longer in the store than in the local cache waits
(``WAITING_FOR_REMOTE_KV``) while the blocks are fetched, then finds them as local cache
hits. With slot sharing (``EngineConfig.swa_directory``), it also waits for another
engine's slot that its prompt extends further than any this engine holds. The engine core
starts both when it adds a request and polls them between steps, on its own thread.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.kvconnector.connector import PendingFetch, StoreConnector
from engine.scheduler.request import Request, RequestStatus
from engine.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.kvconnector.slot_sharing import SlotSharing


class PrefixFetches:
    """The store fetches and peer slot fetches of the requests waiting for remote KV, by
    request id. ``store``: the store connector (None: no store); ``slot_sharing``: this
    engine's part in sharing SWA slots (None: not shared), closed by ``close``."""

    def __init__(
        self, scheduler: Scheduler, store: StoreConnector | None, slot_sharing: SlotSharing | None
    ) -> None:
        self.scheduler = scheduler
        self.store = store
        self.slot_sharing = slot_sharing
        self._fetches: dict[str, PendingFetch] = {}
        self._slot_fetches: dict[str, Future[Any]] = {}  # request id -> a slot fetched from a peer

    @property
    def pending(self) -> bool:
        """Whether any request waits for a fetch."""
        return bool(self._fetches or self._slot_fetches)

    @property
    def num_store_fetches(self) -> int:
        return len(self._fetches)

    def start(self, req: Request) -> tuple[PendingFetch | None, Future[Any] | None]:
        """Start the fetches ``req`` should wait for (before the scheduler takes it): a store
        fetch and a peer's slot, either None. ``add`` them once the scheduler has the request."""
        return self._start_fetch(req), self._start_slot_fetch(req)

    def add(self, request_id: str, fetch: PendingFetch | None, slot_fetch: Future[Any] | None) -> None:
        if fetch is not None:
            self._fetches[request_id] = fetch
        if slot_fetch is not None:
            self._slot_fetches[request_id] = slot_fetch

    def drop(self, request_id: str) -> None:
        """Forget the request's fetches (it ended): their results are never used."""
        self._fetches.pop(request_id, None)
        self._slot_fetches.pop(request_id, None)

    def _start_fetch(self, req: Request) -> PendingFetch | None:
        """After the local prefix match, ask the store for the rest of the prompt's full blocks
        (at least one token is always left to compute). The local run is pinned so that it is
        still there when the fetched blocks join it."""
        cfg = self.scheduler.config
        if self.store is None or req.fork_of or not cfg.enable_prefix_caching:
            return None
        usable = (len(req.prompt_token_ids) - 1) // cfg.block_size
        hashes = self.scheduler.cache.hasher_for(req).update(req.prompt_token_ids)[:usable]
        blocks = self.scheduler.cache.blocks
        local = blocks.lookup(hashes, count=False)
        if len(local) == len(hashes):
            return None
        blocks.acquire(local)
        req.pinned_blocks = list(local)
        return self.store.fetch(hashes[len(local) :])

    def _start_slot_fetch(self, req: Request) -> Future[Any] | None:
        """With slot sharing: fetch another engine's slot that the prompt extends further than
        any this engine holds (its blocks come from this engine's cache or the store fetch)."""
        cfg = self.scheduler.config
        if self.slot_sharing is None or req.fork_of or not cfg.enable_prefix_caching:
            return None
        tokens = req.prompt_token_ids
        hashes = self.scheduler.cache.hasher_for(req).update(tokens)[: (len(tokens) - 1) // cfg.block_size]
        return self.slot_sharing.start_fetch(tokens, hashes, cfg.block_size)

    def poll(self) -> None:
        """Take the fetches that are done: a store fetch's verified blocks are registered in
        the local cache (pinned for the request) and their loads queued; a request is ready
        once neither of its fetches is pending."""
        sched = self.scheduler
        for rid, fetch in list(self._fetches.items()):
            if not fetch.done():
                continue
            del self._fetches[rid]
            req = sched.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            payloads = fetch.result()
            blocks = sched.cache.blocks
            fresh = blocks.allocate(min(len(payloads), blocks.num_available))
            for block, h, payload in zip(fresh, fetch.hashes, payloads):
                if blocks.register(block, h):  # else another request published it meanwhile
                    sched.queue_kv_load(block, payload)
            req.pinned_blocks.extend(fresh)
            if rid not in self._slot_fetches:
                sched.remote_kv_ready(rid)
        for rid, future in list(self._slot_fetches.items()):  # the entry is in the pool already
            if not future.done():
                continue
            del self._slot_fetches[rid]
            req = sched.requests.get(rid)
            if (
                req is not None
                and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
                and rid not in self._fetches
            ):
                sched.remote_kv_ready(rid)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for any pending fetch to finish."""
        waiting = [f.future for f in self._fetches.values()] + list(self._slot_fetches.values())
        concurrent.futures.wait(waiting, timeout_s)

    def close(self) -> None:
        if self.slot_sharing is not None:
            self.slot_sharing.close()  # withdraws this engine's slots from the directory
            self.slot_sharing = None
