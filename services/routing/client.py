"""``RoutedEngineClient``: N engine replicas behind the router's policies, as one ``EngineClient``.

Data parallel: every replica runs prefill and decode of the requests it is given, so one
decision per request, taken by the **prefill** policy, places it (the decode policy, e.g.
the 2D balancer, decides only when prefill and decode pools are split). Per request:

1. ``_sync``: drain every replica's prefix-cache events (``take_cache_events``) into the
   router's global ``PrefixIndex`` (a snapshot first when the replica lost events), and
   report each replica's load with ``update_loads``: requests in it and KV tokens held
   (its stats), and queued prefill work: the predicted prefill seconds of the requests
   routed to it whose first output has not come back yet (closed loop: work leaves the
   queue when the engine has really prefilled it, not when a clock says it should have).
   With a KV store, the blocks each replica saw in the store (``take_store_events``) go
   to the index's store view (``on_store_directory``), and the replicas' measured fetch
   seconds per block (stat ``kv_store_fetch_s_per_block``, mean over those that measured
   one) become the policy's store fetch cost; until one is measured the store is ignored;
2. hash the prompt ids exactly as the engines do (``engine.scheduler.hashing.chain_hashes``
   with the replicas' block size and extra keys) into a ``RequestView``;
3. ``route_prefill`` over the replicas that are up; the chosen replica's ``generate``
   streams the outputs back unchanged;
4. when the request finishes, is aborted (client gone, ``abort``) or fails, the policy's
   ``on_complete`` releases what ``select`` charged.

With SWA slot sharing (the replicas report their slot server, ``ModelInfo.swa_holder``, and
one SWA directory that is not ``memory``), step 3 first looks the prompt's slot up in the
directory when some candidate's prefix index matched a block: the longest slot the prompt
extends, the replicas that hold it and what fetching it costs the others go into the
``RequestView`` (``services.routing.swa_slots``), so a policy costs each replica's hit with
``cached_tokens(m, engine)``. The lookup runs on a worker thread, bounded by
``SlotLookupConfig.timeout_s``; on an error or timeout the request is routed as without it
(counted: ``sluice_router_swa_lookup_failures``).

A replica that is down (its engine thread stopped or died, or it raised
``EngineUnavailable``) is dropped from the index and from the candidates; a request that it
refused before producing anything is routed again to another replica.
``EngineUnavailable`` reaches the caller only when no replica is up.

``RoutingConfig`` and ``SlotLookupConfig`` are in ``services.routing.config``, ``usable_slot``
in ``services.routing.swa_slots``, and what ``stats`` and ``metric_families`` report is
assembled in ``services.routing.metrics``; the moved names stay importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

from prometheus_client.core import Metric

from costmodel import CostModel
from engine.kvconnector.connector import ConnectorConfig
from engine.kvconnector.swa_directory import SlotDirectory, open_slot_directory
from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import ROOT_HASH, ExtraKeys, ImageSpan, chain_hashes
from router.policy import RequestView
from services.api.engine_client import (
    EngineBusy,
    EngineClient,
    EngineOutput,
    EngineRequest,
    EngineStats,
    EngineUnavailable,
    ModelInfo,
)
from services.routing.adapter import RouterAdapter, RouterAdapterConfig
from services.routing.config import ROUTER_POLICIES, RoutingConfig, SlotLookupConfig
from services.routing.metrics import MEAN_EXTRA_STATS, mean_measured, merge_stats, router_families
from services.routing.swa_slots import slot_view, usable_slot

# names that moved to config.py, metrics.py and swa_slots.py, still imported from here
__all__ = [
    "MEAN_EXTRA_STATS",
    "ROUTER_POLICIES",
    "ReplicaEngine",
    "RoutedEngineClient",
    "RoutingConfig",
    "SlotLookupConfig",
    "accepting",
    "usable_slot",
]

log = logging.getLogger(__name__)


def accepting(replica: object) -> bool:
    """Whether a replica may be given new work: up and not draining."""
    return bool(getattr(replica, "alive", False)) and not getattr(replica, "draining", False)


@runtime_checkable
class ReplicaEngine(EngineClient, Protocol):
    """An ``EngineClient`` that also says how it names cached blocks and what it cached.

    - ``alive``: started and not stopped or dead; cheap, no round trip.
    - ``cache_identity()``: (block size, ``ExtraKeys``) used by its block hashes; after
      ``start``; raises ``EngineUnavailable`` before.
    - ``take_cache_events()``: the ``CacheEventBatch`` recorded since the previous call;
      never blocks; an empty batch when the engine records no events.

    Optional (looked up with ``getattr``; a replica without a KV store may omit it):
    ``take_store_events() -> list[bytes]``, the block hashes the engine saw in the KV
    store (written or fetched) since the previous call; never blocks. Its stats may carry
    ``kv_store_fetch_s_per_block`` (measured mean; 0.0 before the first answered fetch).
    ``draining: bool``: the engine finishes what it holds and takes nothing new (absent:
    never draining).
    """

    @property
    def alive(self) -> bool: ...

    def cache_identity(self) -> tuple[int, ExtraKeys]: ...

    def take_cache_events(self) -> CacheEventBatch: ...


class RoutedEngineClient:
    """Route every request to one of ``replicas`` with the router policy ``policy``."""

    def __init__(
        self,
        replicas: Sequence[ReplicaEngine],
        policy: str = "sluice",
        cost: CostModel | None = None,
        store_capacity_blocks: int | None = None,
        slot_lookup: SlotLookupConfig | None = None,
        slot_directory: SlotDirectory | None = None,
    ) -> None:
        """``slot_directory``: the SWA directory to look slots up in (default: the one the
        replicas report after ``start``, opened then; see the module doc)."""
        if not replicas:
            raise ValueError("RoutedEngineClient needs at least one replica")
        infos = [r.model_info() for r in replicas]
        if len({(i.model_id, i.vocab_size, i.eos_token_ids) for i in infos}) != 1:
            raise ValueError(f"replicas serve different models: {sorted({i.model_id for i in infos})}")
        self.replicas = list(replicas)
        self.policy = policy
        n = len(replicas)
        # The store drops blocks silently (node LRU, TTLs), so the router's view of it is a
        # bounded hint: by default as many blocks as the replicas keep for it to drain.
        store_cap = store_capacity_blocks
        if store_cap is None:
            store_cap = n * ConnectorConfig().stored_events
        adapter_cfg = RouterAdapterConfig(
            policy=policy, num_prefill=n, num_decode=1, cost=cost or CostModel(),
            store_capacity_blocks=store_cap,
        )  # fmt: skip
        self.router = RouterAdapter(adapter_cfg)
        self.routed = [0] * n  # requests routed to each replica
        self.prompt_tokens = [0] * n  # prompt tokens of finished requests, per replica
        self.hit_tokens = [0] * n  # of which served from the replica's prefix cache
        self.events_lost = [0] * n
        self.store_events = [0] * n  # store block hashes each replica reported
        self.failovers = 0
        self._info = min(infos, key=lambda i: i.context_limit)
        self._where: dict[str, int] = {}
        # per replica: predicted prefill seconds of requests routed there whose first output
        # has not come back yet (their prefill is queued or running): the queued work report
        self._prefilling: list[dict[str, float]] = [{} for _ in range(n)]
        self._down: set[int] = set()
        self._identity: tuple[int, ExtraKeys] | None = None
        self._t0 = time.monotonic()
        self.slot_lookup = slot_lookup or SlotLookupConfig()
        self._slots = slot_directory
        self._own_slots = False  # opened by start: closed by close
        self._slot_worker: ThreadPoolExecutor | None = None
        self.swa_lookups = self.swa_lookup_failures = self.swa_slots_found = 0

    @classmethod
    def in_process(
        cls, model_dir: str | Path, config: RoutingConfig, **engine_kwargs: Any
    ) -> RoutedEngineClient:
        """``config.replicas`` in-process engines on ``model_dir``, each recording cache events."""
        from engine.llm import COST_MODEL_FILE
        from services.api.inprocess import InProcessEngineClient

        cfg = config.resolve()
        kwargs = {**engine_kwargs, "cache_event_capacity": cfg.cache_event_capacity}
        replicas = [InProcessEngineClient(model_dir, **kwargs) for _ in range(cfg.replicas)]
        path = cfg.cost_model_path or Path(model_dir) / COST_MODEL_FILE
        cost = CostModel.from_json(path.read_text()) if path.is_file() else None
        return cls(replicas, cfg.policy, cost, cfg.store_capacity_blocks, cfg.slot_lookup)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))
        identities = {(bs, extra.encode()) for bs, extra in (r.cache_identity() for r in self.replicas)}
        if len(identities) != 1:
            raise ValueError("replicas hash cached blocks differently (block size or extra keys differ)")
        self._identity = self.replicas[0].cache_identity()
        if self._slots is None:
            infos = [r.model_info() for r in self.replicas]
            urls = {i.swa_directory for i in infos if i.swa_holder is not None and i.swa_directory}
            if len(urls) == 1 and (url := urls.pop()) != "memory":  # "memory": each engine's own
                self._slots, self._own_slots = open_slot_directory(url), True
        if self._slots is not None:
            self._slot_worker = ThreadPoolExecutor(2, thread_name_prefix="sluice-swa-lookup")

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)
        if self._slot_worker is not None:
            self._slot_worker.shutdown(wait=False, cancel_futures=True)
            self._slot_worker = None
        if self._own_slots and self._slots is not None:
            self._slots.close()
            self._slots, self._own_slots = None, False

    # -- EngineClient ----------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._info

    async def ready(self, timeout_s: float = 5.0) -> bool:
        """Ready when at least one replica is (the others are out of the candidates)."""
        up = [r for r in self.replicas if r.alive]
        if not up:
            return False
        return any(await asyncio.gather(*(r.ready(timeout_s) for r in up)))

    async def abort(self, request_id: str) -> None:
        engine = self._where.get(request_id)
        if engine is not None:
            await self.replicas[engine].abort(request_id)

    def stats(self) -> EngineStats:
        """The replicas' stats summed, their measured means averaged (``merge_stats``)."""
        per = [r.stats() for r in self.replicas]
        return merge_stats(per, sum(1 for r in self.replicas if r.alive))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        view = await self._view(request)
        tried: set[int] = set()
        while True:
            engine = await self._route(view, tried, request)
            produced = False
            self._where[request.request_id] = engine
            outputs = self.replicas[engine].generate(request)
            try:
                async for out in outputs:
                    if not produced:
                        produced = True
                        self._prefilling[engine].pop(request.request_id, None)  # prefill done
                    if out.finish_reason is not None:
                        self.prompt_tokens[engine] += out.prompt_tokens
                        self.hit_tokens[engine] += out.cached_tokens
                    yield out
                return
            except EngineBusy:
                raise  # no room downstream (backpressure): the replica is fine
            except EngineUnavailable:
                await self._mark_down(engine)
                if produced:
                    raise
                tried.add(engine)
                self.failovers += 1
            finally:
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:  # the replica aborts the request and frees its blocks now
                    await aclose()
                self._where.pop(request.request_id, None)
                self._prefilling[engine].pop(request.request_id, None)
                await self.router.prefill_done(engine, view)

    # -- routing ---------------------------------------------------------------------------
    async def _view(self, request: EngineRequest) -> RequestView:
        if self._identity is None:
            raise EngineUnavailable("the routed engine client is not started")
        block_size, extra = self._identity
        blocks = chain_hashes(request.prompt_token_ids, block_size, extra, images=self._image_spans(request))
        arrival = time.monotonic() - self._t0
        exact, bounded = self._info.swa_replay_tokens
        mode = request.swa_replay or self._info.swa_replay_default
        return RequestView(
            request.request_id, len(request.prompt_token_ids), blocks, arrival, 0, block_size,
            swa_replay_tokens=bounded if mode == "bounded" else exact,
        )  # fmt: skip

    def _image_spans(self, request: EngineRequest) -> list[ImageSpan]:
        """The request's images as the engines key them (their block hashes include the keys):
        an image encoded by a vision pool carries its key; a preprocessed one is keyed here."""
        from engine.vision.stage import rows_key

        spans = []
        for img in request.images:
            key = getattr(img, "key", None) or rows_key(img, self._info.vision_fingerprint)
            spans.append(ImageSpan(img.offset, img.length, key))
        return spans

    async def _route(self, view: RequestView, tried: set[int], request: EngineRequest | None = None) -> int:
        await self._sync()
        candidates = [i for i, r in enumerate(self.replicas) if accepting(r) and i not in tried]
        if not candidates:
            raise EngineUnavailable(f"no engine replica is up ({len(self.replicas)} configured)")
        matched = self.router.index.match_list(view.blocks)  # before select inserts the blocks
        if request is not None:
            view = await self._with_slot(view, request, max(matched[c] for c in candidates))
        engine = await self.router.route_prefill(view, candidates)
        self.routed[engine] += 1
        self._prefilling[engine][str(view.request_id)] = self.router.config.cost.prefill_time(
            view.input_len, view.cached_tokens(matched[engine], engine)
        )
        return engine

    async def _with_slot(self, view: RequestView, request: EngineRequest, covered: int) -> RequestView:
        """``view`` with the directory slot the prompt extends (module doc), looked up when
        some candidate matched ``covered`` >= 1 blocks; ``view`` unchanged when there is no
        directory, no usable slot, or the lookup failed or timed out."""
        if self._slots is None or self._slot_worker is None or covered < 1:
            return view
        mode = request.swa_replay or self._info.swa_replay_default
        infos = [r.model_info() for r in self.replicas]
        if mode != "bounded" and not all(i.swa_slot_exact for i in infos if i.swa_holder):
            return view  # a lossy slot (MXFP8, ...) serves only requests that accept bounded replay
        prompt, bs = request.prompt_token_ids, view.block_size
        hashes = cast(Sequence[bytes], view.blocks)  # chain_hashes: this client's blocks are bytes
        anchors = [ROOT_HASH, *hashes[: min(covered, (len(prompt) - 1) // bs)]]
        self.swa_lookups += 1
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(
                loop.run_in_executor(self._slot_worker, self._slots.locate, anchors),
                self.slot_lookup.timeout_s,
            )
        except Exception:  # the directory is down or slow: route as without it
            self.swa_lookup_failures += 1
            log.debug("SWA directory lookup failed; routing without it", exc_info=True)
            return view
        slot = usable_slot(found, anchors, prompt, bs)
        if slot is None:
            return view
        self.swa_slots_found += 1
        return slot_view(view, slot, infos, self.replicas, self.router.config.cost, self.slot_lookup)

    async def _sync(self) -> None:
        """Cache events into the index and replica loads into the policy (see module doc)."""
        assert self._identity is not None  # internal invariant: _view checked start
        block_size = self._identity[0]
        loads: list[dict[str, object]] = []
        in_store: list[bytes] = []
        fetch_costs: list[float] = []
        for i, r in enumerate(self.replicas):
            if not r.alive:
                if i not in self._down:
                    await self._mark_down(i)
                continue
            self._down.discard(i)
            batch = r.take_cache_events()
            self.events_lost[i] += batch.lost
            if batch.snapshot is not None:
                await self.router.on_cache_snapshot(i, batch.snapshot)
            for ev in batch.events:
                if ev.kind == "stored":
                    await self.router.on_cache_event(i, stored=ev.hashes)
                else:
                    await self.router.on_cache_event(i, removed=ev.hashes)
            take_store = getattr(r, "take_store_events", None)
            if take_store is not None:
                seen = take_store()
                self.store_events[i] += len(seen)
                in_store.extend(seen)
            s = r.stats()
            fetch_costs.append(s.extra.get("kv_store_fetch_s_per_block", 0.0))
            used = max(s.total_blocks - s.free_blocks, 0) * block_size
            queued = sum(self._prefilling[i].values())
            loads.append(
                {"engine": i, "running": s.running + s.waiting, "kv_tokens": used, "queued_work_s": queued}
            )
        if loads:
            await self.router.on_engine_stats("prefill", loads)
        if in_store:
            await self.router.on_store_directory(added=in_store)
        fetch_s = mean_measured(fetch_costs)
        if fetch_s is not None and fetch_s != self.router.config.store_fetch_s_per_block:
            await self.router.set_store_fetch_cost(fetch_s)

    async def _mark_down(self, engine: int) -> None:
        self._down.add(engine)
        await self.router.on_engine_down(engine)

    # -- metrics (services.api.metrics.MetricsSource) ---------------------------------------
    def metric_families(self) -> Iterator[Metric]:
        """The ``sluice_router_*`` series, read from this client's counters (``router_families``)."""
        return router_families(self)
