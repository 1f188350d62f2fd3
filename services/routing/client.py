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

A replica that is down (its engine thread stopped or died, or it raised
``EngineUnavailable``) is dropped from the index and from the candidates; a request that it
refused before producing anything is routed again to another replica.
``EngineUnavailable`` reaches the caller only when no replica is up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from costmodel import CostModel
from engine.kvconnector.connector import ConnectorConfig
from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import ExtraKeys, chain_hashes
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

ROUTER_POLICIES = ("round_robin", "least_load", "cache_aware", "sluice")
# Engine stats that are per-replica means, not counters: ``stats()`` averages them over the
# replicas that measured one (> 0) instead of summing them.
MEAN_EXTRA_STATS = frozenset({"kv_store_fetch_s_per_block"})


@dataclass(frozen=True)
class RoutingConfig:
    """How ``sluice serve`` spreads requests over in-process engine replicas.

    ``policy`` "" means no router (exactly one replica, served directly); ``resolve`` picks
    ``sluice`` when there are several replicas and no policy was named.
    """

    replicas: int = 1
    policy: str = ""
    cache_event_capacity: int = 65_536  # block events buffered per replica before resnapshot
    # prefill cost model of one replica (CostModel JSON); None: the checkpoint's
    # sluice_cost_model.json when present (as the engine's scheduler), else the H200 default
    cost_model_path: Path | None = None
    # blocks the router's view of the KV store keeps (LRU); None: replicas x the blocks one
    # engine keeps for the router to drain (ConnectorConfig.stored_events, 65,536)
    store_capacity_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(
                f"RoutingConfig.replicas must be >= 1 (engine replicas to serve), got {self.replicas}"
            )
        if self.policy and self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; known: {', '.join(ROUTER_POLICIES)}")
        if self.cost_model_path is not None and not self.cost_model_path.is_file():
            raise ValueError(
                f"router cost model {self.cost_model_path} is not a file (fit one with `sluice bench engine --profile`)"
            )
        if self.cache_event_capacity < 1:
            raise ValueError(
                f"RoutingConfig.cache_event_capacity must be >= 1 block event, got {self.cache_event_capacity}"
            )
        if self.store_capacity_blocks is not None and self.store_capacity_blocks < 1:
            raise ValueError(
                f"RoutingConfig.store_capacity_blocks must be >= 1 or None (default bound), "
                f"got {self.store_capacity_blocks}"
            )

    def resolve(self) -> RoutingConfig:
        if self.replicas > 1 and not self.policy:
            return replace(self, policy="sluice")
        return self

    @property
    def routed(self) -> bool:
        return bool(self.policy) or self.replicas > 1


def _mean_measured(values: Iterable[float]) -> float | None:
    """Mean of the values > 0 (a replica reports 0.0 until it measured something); None
    when none is."""
    measured = [v for v in values if v > 0]
    return sum(measured) / len(measured) if measured else None


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
    ) -> None:
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
        return cls(replicas, cfg.policy, cost, cfg.store_capacity_blocks)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))
        identities = {(bs, extra.encode()) for bs, extra in (r.cache_identity() for r in self.replicas)}
        if len(identities) != 1:
            raise ValueError("replicas hash cached blocks differently (block size or extra keys differ)")
        self._identity = self.replicas[0].cache_identity()

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)

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
        per = [r.stats() for r in self.replicas]
        extra: dict[str, float] = {}
        for s in per:
            for k, v in s.extra.items():
                extra[k] = extra.get(k, 0.0) + v
        for k in MEAN_EXTRA_STATS & extra.keys():
            extra[k] = _mean_measured(s.extra.get(k, 0.0) for s in per) or 0.0
        extra["replicas_up"] = float(sum(1 for r in self.replicas if r.alive))

        def total(name: str) -> int:
            return sum(int(getattr(s, name)) for s in per)

        return EngineStats(
            running=total("running"), waiting=total("waiting"), free_blocks=total("free_blocks"),
            total_blocks=total("total_blocks"), requests_total=total("requests_total"),
            aborted_total=total("aborted_total"), finished_total=total("finished_total"),
            steps=total("steps"), extra=extra,
        )  # fmt: skip

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        view = await self._view(request)
        tried: set[int] = set()
        while True:
            engine = await self._route(view, tried)
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
        blocks = chain_hashes(request.prompt_token_ids, block_size, extra)
        arrival = time.monotonic() - self._t0
        exact, bounded = self._info.swa_replay_tokens
        mode = request.swa_replay or self._info.swa_replay_default
        return RequestView(
            request.request_id, len(request.prompt_token_ids), blocks, arrival, 0, block_size,
            swa_replay_tokens=bounded if mode == "bounded" else exact,
        )  # fmt: skip

    async def _route(self, view: RequestView, tried: set[int]) -> int:
        await self._sync()
        candidates = [i for i, r in enumerate(self.replicas) if r.alive and i not in tried]
        if not candidates:
            raise EngineUnavailable(f"no engine replica is up ({len(self.replicas)} configured)")
        matched = self.router.index.match_list(view.blocks)  # before select inserts the blocks
        engine = await self.router.route_prefill(view, candidates)
        self.routed[engine] += 1
        self._prefilling[engine][str(view.request_id)] = self.router.config.cost.prefill_time(
            view.input_len, view.cached_tokens(matched[engine])
        )
        return engine

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
        fetch_s = _mean_measured(fetch_costs)
        if fetch_s is not None and fetch_s != self.router.config.store_fetch_s_per_block:
            await self.router.set_store_fetch_cost(fetch_s)

    async def _mark_down(self, engine: int) -> None:
        self._down.add(engine)
        await self.router.on_engine_down(engine)

    # -- metrics (services.api.metrics.MetricsSource) ---------------------------------------
    def metric_families(self) -> Iterator[Metric]:
        per_replica = (
            ("sluice_router_routed_requests", "Requests routed to each replica.", self.routed),
            ("sluice_router_prompt_tokens", "Prompt tokens of finished requests, per replica.", self.prompt_tokens),
            ("sluice_router_prefix_hit_tokens", "Prompt tokens served from each replica's prefix cache.",
             self.hit_tokens),
            ("sluice_router_cache_events_lost", "Cache events a replica dropped (then resnapshotted).",
             self.events_lost),
            ("sluice_router_store_events", "KV-store block hashes a replica reported to the router.",
             self.store_events),
        )  # fmt: skip
        for name, doc, values in per_replica:
            c = CounterMetricFamily(name, doc, labels=["replica", "policy"])
            for i, v in enumerate(values):
                c.add_metric([str(i), self.policy], float(v))
            yield c
        up = GaugeMetricFamily(
            "sluice_router_replica_up", "1 while the replica can be routed to.", labels=["replica"]
        )
        blocks = GaugeMetricFamily(
            "sluice_router_index_blocks",
            "Blocks the router's prefix index holds per replica.",
            labels=["replica"],
        )
        for i, r in enumerate(self.replicas):
            up.add_metric([str(i)], float(r.alive))
            blocks.add_metric([str(i)], float(self.router.index.engine_blocks(i)))
        yield up
        yield blocks
        yield GaugeMetricFamily(
            "sluice_router_store_blocks",
            "Blocks the router's view of the KV store holds (a bounded hint, see docs/router.md).",
            value=float(self.router.index.store_blocks()),
        )
        yield GaugeMetricFamily(
            "sluice_router_store_fetch_seconds_per_block",
            "Store fetch cost the router prices store hits at (engines' measured mean; 0: unmeasured, store ignored).",
            value=float(self.router.config.store_fetch_s_per_block or 0.0),
        )
        yield CounterMetricFamily(
            "sluice_router_failovers",
            "Requests re-routed after a replica refused them.",
            value=self.failovers,
        )
