"""``RayServingClient``: the API's ``EngineClient`` over prefill and decode pools of Ray actors.

``start`` creates the engine actors (``EngineActor``, one per engine, placed by the pool's
Ray resources), loads them in parallel, then routes over them:

* the router (``RoutedEngineClient`` with the named policy, ``sluice`` by default: length
  tier, prefix affinity over the engines' caches and the KV store, queued work) picks a
  prefill engine per request, from state the engines push (``RayEngineReplica``);
* each prefill engine hands its requests to the ``DecodeSet`` (2D balancer, reservation);
* with no decode pool (``decode.engines == 0``) the prefill pool's engines run requests
  whole: colocated serving over Ray, the baseline the benchmarks compare against;
* with a vision pool (``vision``: ``VisionActor``s, ``services.ray.vision``) a request's
  images are encoded there first (least outstanding image tokens) and reach the prefill
  engine as rows in the engine's byte format; without one the engines encode them.

The router lives in the API process and is fed by the engines' pushed streams; with more
than one API process each keeps its own router (see docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from services.api.engine_client import EngineOutput, EngineRequest, EngineStats, EngineUnavailable, ModelInfo
from services.ray.decode_set import DecodeSet
from services.ray.handoff import HandoffConfig
from services.ray.metrics import PoolMetrics
from services.ray.replica import RayEngineReplica

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    """One pool: ``engines`` engine actors with the same ``EngineConfig`` fields
    (``engine_config``) and Ray placement (``resources`` per engine, e.g. ``{"decode": 1}``
    or ``{"GPU": 1}``; ``num_cpus`` per engine)."""

    engines: int  # model instances
    engine_config: Mapping[str, Any] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)  # per rank
    num_cpus: float = 0.0  # per rank
    expert_parallel: int = 1  # ranks per instance: each an engine, in lockstep (one placement group)
    eplb: Mapping[str, Any] | None = None  # EplbConfig fields: balance each EP instance's experts

    def __post_init__(self) -> None:
        if self.engines < 0:
            raise ValueError(f"a pool has >= 0 engines, got {self.engines}")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be >= 1, got {self.expert_parallel}")


class RayServingClient:
    """``checkpoint``: the model every engine loads (this process reads its config and
    tokenizer). ``prefill``: the prefill pool (the whole pool when ``decode`` has no
    engines). ``policy`` / ``decode_policy``: the router's prefill and decode policy names
    (``sluice``: prefix- and load-aware prefill, the 2D decode balancer). ``cost``: the router's prefill cost
    model (``costmodel.CostModel``; None: the checkpoint's fitted one, as the engines use,
    else the router's default). ``handoff``: how payloads travel from prefill to decode
    (``services.ray.handoff``; default: Ray's object store)."""

    def __init__(
        self,
        checkpoint: str | Path,
        prefill: PoolConfig,
        decode: PoolConfig,
        *,
        policy: str = "sluice",
        decode_policy: str = "sluice",
        cost: Any = None,
        start_timeout_s: float = 300.0,
        call_timeout_s: float = 120.0,
        deployment: str | None = None,
        attach: bool = False,
        vision: PoolConfig | None = None,
        handoff: HandoffConfig | None = None,
    ) -> None:
        from services.api.inprocess import _read_model_info

        if prefill.engines < 1:
            raise ValueError("the prefill pool needs at least one engine")
        self.checkpoint = Path(checkpoint)
        self.prefill_pool, self.decode_pool = prefill, decode
        self.policy, self.decode_policy, self.cost = policy, decode_policy, cost
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        if attach and not deployment:
            raise ValueError("attach=True needs the deployment whose engine actors to follow")
        self.handoff = handoff or HandoffConfig()
        self.deployment = deployment or uuid.uuid4().hex[:12]
        self.attach = attach
        infos = [
            _read_model_info(self.checkpoint, dict(p.engine_config)) for p in (prefill, decode) if p.engines
        ]
        self._info = min(infos, key=lambda i: i.context_limit)
        self.actors: list[Any] = []
        # the vision pool: ``engines`` instances; ``engine_config`` may set its ``device``,
        # ``dtype`` (default: the prefill engines', the dtype rows travel in) and ``cache_bytes``
        self.vision_pool = vision if vision is not None and vision.engines > 0 else None
        self.vision: Any = None  # services.ray.vision.VisionPool, once started
        self._groups: list[_EPInstance] = []  # the EP instances (expert_parallel > 1)
        self._supervisor: asyncio.Task[None] | None = None
        self.prefill: list[RayEngineReplica] = []
        self.decode: DecodeSet | None = None
        self.router: Any = None  # RoutedEngineClient, once started
        self.metrics = PoolMetrics()

    @property
    def disaggregated(self) -> bool:
        return self.decode_pool.engines > 0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        from services.routing.client import RoutedEngineClient

        if self.router is not None:
            return
        roles = [("prefill" if self.disaggregated else "colocated", self.prefill_pool)]
        if self.disaggregated:
            roles.append(("decode", self.decode_pool))
        made: dict[str, list[tuple[Any, Any]]] = {}
        try:
            for role, pool in roles:
                made[role] = []
                for i in range(pool.engines):
                    if self.attach:
                        for n in self._engine_names(role, i, pool):
                            made[role].append((await self._find(n), n))
                    else:
                        made[role] += self._instance(role, i, pool)
            every = [a for role in made.values() for a, _ in role]
            seers = await self._vision_actors()
            infos = await asyncio.wait_for(
                asyncio.gather(*(a.start.remote() for a in [*every, *(a for a, _ in seers)])),
                self.start_timeout_s,
            )
            if seers:
                from services.ray.vision import VisionPool

                self.vision = VisionPool(
                    [a for a, _ in seers], infos[len(every) :], [n for _, n in seers],
                    call_timeout_s=self.call_timeout_s,
                )  # fmt: skip
                infos = infos[: len(every)]
            by_actor = dict(zip([id(a) for a in every], infos, strict=True))
            if self.disaggregated:
                decode = [
                    RayEngineReplica(
                        a,
                        by_actor[id(a)],
                        name=n,
                        metrics=self.metrics,
                        lookup=self._lookup(n),
                        call_timeout_s=self.call_timeout_s,
                    )  # fmt: skip
                    for a, n in made["decode"]
                ]
                await asyncio.gather(*(r.start() for r in decode))
                self.decode = DecodeSet(decode, self.decode_policy, self._fitted_decode_cost())
            front = "prefill" if self.disaggregated else "colocated"
            self.prefill = [
                RayEngineReplica(
                    a,
                    by_actor[id(a)],
                    self.decode,
                    name=n,
                    metrics=self.metrics,
                    lookup=self._lookup(n),
                    call_timeout_s=self.call_timeout_s,
                )
                for a, n in made[front]
            ]
            self.router = RoutedEngineClient(self.prefill, self.policy, self.cost or self._fitted_cost())
            await self.router.start()
            by_name = {r.name: r for r in self._engines()}
            for inst in self._groups:
                inst.replicas = [by_name[n] for n in inst.names]
            if self._groups and not self.attach:
                self._supervisor = asyncio.create_task(self._supervise(), name="sluice-ep-supervisor")
        except BaseException:
            await self.close()
            raise

    async def _vision_actors(self) -> list[tuple[Any, str]]:
        """The vision pool's actors and names (created here, or found when attached)."""
        pool = self.vision_pool
        if pool is None:
            return []
        names = [f"vision-{i}" for i in range(pool.engines)]
        if self.attach:
            return [(await self._find(n), n) for n in names]
        from services.ray.vision import DEFAULT_CACHE_BYTES, remote_vision_actor

        front = self.prefill_pool.engine_config
        cfg = {"device": front.get("device", "cpu"), "dtype": front.get("dtype", "float32"),
               "cache_bytes": DEFAULT_CACHE_BYTES, **dict(pool.engine_config)}  # fmt: skip
        out = []
        for n in names:
            actor = remote_vision_actor(
                str(self.checkpoint), str(cfg["device"]), str(cfg["dtype"]), int(cfg["cache_bytes"]),
                num_cpus=pool.num_cpus, resources=dict(pool.resources), name=self.actor_name(n),
            )  # fmt: skip
            self.actors.append(actor)
            out.append((actor, n))
        return out

    # -- actor names: API replicas find the engines another process started ------------------
    @staticmethod
    def _engine_names(role: str, index: int, pool: PoolConfig) -> list[str]:
        if pool.expert_parallel == 1:
            return [f"{role}-{index}"]
        return [f"{role}-{index}.{rank}" for rank in range(pool.expert_parallel)]

    def actor_name(self, engine: str) -> str:
        """The Ray actor name of ``engine`` (``prefill-0``, ``decode-1.0``) in this deployment."""
        return f"sluice-{self.deployment}-{engine}"

    def _lookup(self, engine: str) -> Any:
        """For an attached client: the actor registered under ``engine``'s name now."""
        if not self.attach:
            return None
        import ray

        return lambda: ray.get_actor(self.actor_name(engine))

    async def _find(self, engine: str) -> Any:
        """The actor of ``engine``, once the process that starts them has registered it."""
        import ray

        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        while True:
            try:
                return ray.get_actor(self.actor_name(engine))
            except ValueError:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(
                        f"engine actor {self.actor_name(engine)!r} did not appear within {self.start_timeout_s} s"
                    ) from None
                await asyncio.sleep(0.2)

    async def _names_free(self, engines: list[str], timeout_s: float = 30.0) -> None:
        """Wait until Ray has released the names of killed actors (so new ones can take them)."""
        import ray

        deadline = asyncio.get_running_loop().time() + timeout_s
        for engine in engines:
            while True:
                try:
                    ray.get_actor(self.actor_name(engine))
                except ValueError:
                    break  # free
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(
                        f"actor name {self.actor_name(engine)!r} still taken after {timeout_s} s"
                    )
                await asyncio.sleep(0.1)

    def _fitted_decode_cost(self) -> Any:
        """The decode cost model fitted to step times measured for this checkpoint on this
        hardware (``sluice bench engine --profile`` writes them beside the weights), else
        None: the router's default, from DeepInfer's published H200 figures (docs/router.md)."""
        from engine.engine_config import DECODE_STEPS_FILE
        from router.steptable import StepTable

        path = self.checkpoint / DECODE_STEPS_FILE
        if not path.is_file():
            log.warning(
                "no measured decode step times beside %s: the decode balancer uses its default cost model "
                "(run `sluice bench engine --profile --model %s` on this hardware)", self.checkpoint, self.checkpoint,
            )  # fmt: skip
            return None
        # fitted over the cells a decode engine of this model can reach: sequences no deeper
        # on average than its context limit
        return StepTable.load(path).fit(max_tokens_per_sequence=self._info.context_limit)

    def _fitted_cost(self) -> Any:
        """The prefill cost model fitted for this checkpoint (``sluice bench engine --profile``
        writes it beside the weights, where the engines' schedulers read it too), else None:
        the router's default, an H200 fit (docs/router.md)."""
        from costmodel import CostModel
        from engine.engine_config import COST_MODEL_FILE

        path = self.checkpoint / COST_MODEL_FILE
        return CostModel.from_json(path.read_text()) if path.is_file() else None

    def _actor_config(self, pool: PoolConfig) -> dict[str, Any]:
        """An engine actor's configuration: its pool's, and with a vision pool no encoder of
        its own (the pool encodes every image; the engine only verifies the rows it is sent)."""
        return {**pool.engine_config, **({"encode_images": False} if self.vision_pool else {})}

    def _instance(self, role: str, index: int, pool: PoolConfig) -> list[tuple[Any, str]]:
        """The actors of one model instance: one engine, or one per EP rank in a placement
        group (``PACK``: as few nodes as hold it, one when it fits) whose ranks meet through
        a rendezvous actor (``services.ray.rendezvous``), wherever they run."""
        from services.ray.actors import remote_engine_actor

        opts: dict[str, Any] = {"num_cpus": pool.num_cpus, "resources": dict(pool.resources)}
        if pool.expert_parallel == 1:
            (name,) = self._engine_names(role, index, pool)
            actor = remote_engine_actor(
                role, str(self.checkpoint), self._actor_config(pool), pool_resource=False,
                handoff=asdict(self.handoff), name=self.actor_name(name), **opts,
            )  # fmt: skip
            self.actors.append(actor)
            return [(actor, name)]
        from ray.util.placement_group import placement_group

        bundle = {**dict(pool.resources), **({"CPU": pool.num_cpus} if pool.num_cpus else {})}
        pg = placement_group([dict(bundle) for _ in range(pool.expert_parallel)], strategy="PACK")
        names = self._engine_names(role, index, pool)
        inst = _EPInstance(role, pool, pg, names)
        self._groups.append(inst)
        inst.actors = self._rank_actors(inst)
        self.actors += inst.actors
        return list(zip(inst.actors, names, strict=True))

    def _rank_actors(self, inst: _EPInstance) -> list[Any]:
        """One engine actor per rank of ``inst``, in its placement group's bundles, meeting
        through a new rendezvous actor (a restarted group starts from empty keys)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from services.ray.actors import remote_engine_actor
        from services.ray.rendezvous import start_rendezvous

        pool = inst.pool
        rendezvous = self.actor_name(f"{inst.names[0].rsplit('.', 1)[0]}-rendezvous-{uuid.uuid4().hex[:8]}")
        inst.rendezvous = start_rendezvous(rendezvous)
        out = []
        for rank in range(pool.expert_parallel):
            ep = {"rank": rank, "size": pool.expert_parallel, "rendezvous": rendezvous}
            out.append(
                remote_engine_actor(
                    inst.role,
                    str(self.checkpoint),
                    self._actor_config(pool),
                    pool_resource=False,
                    ep=ep,
                    eplb=pool.eplb,
                    handoff=asdict(self.handoff),
                    num_cpus=pool.num_cpus,
                    resources=dict(pool.resources),
                    name=self.actor_name(inst.names[rank]),
                    max_restarts=0,  # a lone restarted rank cannot rejoin its group: the group restarts whole
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        inst.pg, placement_group_bundle_index=rank
                    ),
                )  # fmt: skip
            )
        return out

    # -- draining one engine ---------------------------------------------------------------
    async def set_draining(self, engine: str, draining: bool) -> dict[str, Any]:
        """Drain engine ``engine`` (a name such as ``decode-1``): the routers and the decode
        balancer of every API process stop giving it new requests, and it finishes the ones
        it holds, e.g. before maintenance of its host; ``draining=False`` gives it work
        again. The flag lives in the engine actor and reaches the other API processes with
        its pushed state. Returns the engine's row (``engines``). ``KeyError``: no such engine."""
        r = self._replica(engine)
        await r.set_draining(draining)
        return self._row(r)

    def drained(self, engine: str) -> bool:
        """Whether a draining engine holds nothing any more (from its pushed state)."""
        return self._replica(engine).drained

    def engines(self) -> list[dict[str, Any]]:
        """One row per engine (each rank of an EP instance): name, pool, host (Ray node IP),
        pid, up, draining, drained, running and waiting requests, KV tokens held (the
        pushed state this process sees)."""
        return [self._row(r) for r in self._engines()]

    @staticmethod
    def _row(r: RayEngineReplica) -> dict[str, Any]:
        st = r.stats()
        return {
            "name": r.name, "pool": r.pool, "host": r.info.get("node_ip", ""), "pid": r.info.get("pid"),
            "alive": r.alive, "draining": r.draining,
            "drained": r.drained, "running": st.running, "waiting": st.waiting,
            "kv_tokens": int(st.extra.get("kv_tokens", 0.0)),
        }  # fmt: skip

    def _engines(self) -> list[RayEngineReplica]:
        return [*self.prefill, *(self.decode.replicas if self.decode else [])]

    def _replica(self, engine: str) -> RayEngineReplica:
        for r in self._engines():
            if r.name == engine:
                return r
        raise KeyError(f"no engine {engine!r} in this deployment")

    # -- supervision of EP instances ---------------------------------------------------------
    async def _supervise(self) -> None:
        """Restart an EP instance whole when one of its ranks is down. Its peers' collectives
        fail within the group's timeout (5 s), so a dead rank takes its instance down; the
        instance's requests recover meanwhile (prefill: retried on another instance; decode:
        resumed elsewhere from the handoff payload). At most ``MAX_GROUP_RESTARTS`` times."""
        while True:
            await asyncio.sleep(SUPERVISE_EVERY_S)
            for inst in self._groups:
                if inst.restarts >= MAX_GROUP_RESTARTS or all(r.alive for r in inst.replicas):
                    continue
                try:
                    await self._restart_group(inst)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - try again on the next round
                    log.error("EP instance %s could not restart: %r", inst.names[0].rsplit(".", 1)[0], exc)

    async def _restart_group(self, inst: _EPInstance) -> None:
        import ray

        name = inst.names[0].rsplit(".", 1)[0]
        inst.restarts += 1
        log.warning("EP instance %s lost a rank: restarting its %d ranks (restart %d)", name,
                    len(inst.names), inst.restarts)  # fmt: skip
        for r in inst.replicas:  # out of the router's candidates until the group is back
            await r.close()
        for a in [*inst.actors, inst.rendezvous]:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        old = {id(a) for a in inst.actors}
        await self._names_free(inst.names)
        inst.actors = self._rank_actors(inst)
        self.actors = [a for a in self.actors if id(a) not in old] + inst.actors
        infos = await asyncio.wait_for(
            asyncio.gather(*(a.start.remote() for a in inst.actors)), self.start_timeout_s
        )
        for r, a, info in zip(inst.replicas, inst.actors, infos, strict=True):
            await r.rebind(a, info)
        log.warning("EP instance %s is back at full strength", name)

    async def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
            self._supervisor = None
        if self.router is not None:
            await self.router.close()
            self.router = None
        self.vision = None
        if self.decode is not None:
            await asyncio.gather(*(r.close() for r in self.decode.replicas), return_exceptions=True)
        if self.attach:  # the engines belong to the process that started them
            self.prefill, self.decode = [], None
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(a.close.remote() for a in self.actors), return_exceptions=True), 30
            )
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        for inst in self._groups:
            with contextlib.suppress(Exception):
                ray.kill(inst.rendezvous)
            with contextlib.suppress(Exception):
                remove_placement_group(inst.pg)
        self.actors, self.prefill, self.decode, self._groups = [], [], None, []

    # -- EngineClient ----------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._info

    async def ready(self, timeout_s: float = 5.0) -> bool:
        if self.router is None:
            return False
        if self.decode is not None and not any(r.alive for r in self.decode.replicas):
            return False
        return await self.router.ready(timeout_s)

    async def abort(self, request_id: str) -> None:
        if self.router is not None:
            await self.router.abort(request_id)

    def stats(self) -> EngineStats:
        """The engines' counters; ``extra`` also has the vision pool's totals (``vision_pool_*``)."""
        out = self._engine_stats()
        if self.vision is None:
            return out
        return replace(out, extra={**out.extra, **self.vision.stats()})

    def _engine_stats(self) -> EngineStats:
        if self.router is None:
            return EngineStats(0, 0, 0, 0, 0, 0, 0, 0)
        front = self.router.stats()
        if self.decode is None:
            return front
        return merge_decode_stats(front, [r.stats() for r in self.decode.replicas])

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self.router is None:
            raise EngineUnavailable("the Ray serving client is not started")
        if self.vision is not None and request.images:
            request = await self.vision.encode(request)
        async with aclosing(self.router.generate(request)) as outs:  # closed now, not at GC
            async for out in outs:
                yield out

    # -- metrics (services.api.metrics.MetricsSource) ---------------------------------------
    def metric_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        if self.router is None:
            return
        yield from self.router.metric_families()
        engines = [(r.pool, r) for r in self.prefill]
        if self.decode is not None:
            engines += [("decode", r) for r in self.decode.replicas]
        yield from self.metrics.families(engines)
        if self.vision is not None:
            yield from self.vision.families()
        if self.decode is None:
            return
        placed = CounterMetricFamily(
            "sluice_decode_placed_requests", "Requests placed on each decode engine.", labels=["engine"]
        )
        for i, r in enumerate(self.decode.replicas):
            placed.add_metric([r.name], float(self.decode.placed[i]))
        yield placed
        yield CounterMetricFamily(
            "sluice_decode_reservations_refused", "Decode reservations refused (backpressure).",
            value=float(self.decode.refused),
        )  # fmt: skip
        yield from _decode_cost_families(self.decode)


def merge_decode_stats(front: EngineStats, per: list[EngineStats]) -> EngineStats:
    """The prefill front's stats with the decode engines': levels and counts summed (a decode
    engine's extras as ``decode_*``), speculation's counters under their own names (it runs
    in decode engines only, so /metrics reports them as one engine's ``sluice_spec_*``), and
    its measured cost scales, ratios per engine, averaged over the engines."""
    extra = dict(front.extra)
    scales: dict[str, list[float]] = {}
    for s in per:
        for k, v in s.extra.items():
            if k.startswith("spec_cost_scale_"):
                scales.setdefault(k, []).append(v)
                continue
            key = k if k.startswith("spec_") else f"decode_{k}"
            extra[key] = extra.get(key, 0.0) + v
    extra.update({k: sum(v) / len(v) for k, v in scales.items()})
    return EngineStats(
        running=front.running + sum(s.running for s in per),
        waiting=front.waiting + sum(s.waiting for s in per),
        free_blocks=front.free_blocks + sum(s.free_blocks for s in per),
        total_blocks=front.total_blocks + sum(s.total_blocks for s in per),
        requests_total=front.requests_total,
        aborted_total=front.aborted_total + sum(s.aborted_total for s in per),
        finished_total=front.finished_total + sum(s.finished_total for s in per),
        steps=front.steps + sum(s.steps for s in per),
        extra=extra,
    )


def _decode_cost_families(decode: DecodeSet) -> Iterator[Any]:
    """The decode balancer's step-time model (``DecodeSet``), its prior refitted whole to the
    plain decode steps the engines served (``costmodel.online``), and how well each predicts
    those steps."""
    from prometheus_client.core import GaugeMetricFamily

    from costmodel.online import HALF_LIFE_STEPS

    decode.refit()
    refitted = decode.refitted
    for name, what, model in (
        ("sluice_decode_cost_model", "The decode balancer's step-time model", decode.decode_cost),
        ("sluice_decode_cost_refit", "The step-time model of the decode engines' served steps", refitted),
    ):
        fam = GaugeMetricFamily(
            name,
            f"{what}, d0 + d1*B + d2*K: d0 in seconds, d1 in seconds per running request, d2 in "
            "seconds per KV token.",
            labels=["term"],
        )
        for term in ("d0", "d1", "d2"):
            fam.add_metric([term], float(getattr(model, term)))
        yield fam
    yield GaugeMetricFamily(
        "sluice_decode_cost_refit_steps",
        "Served decode steps behind the refit (older ones fade: a half-life of "
        f"{HALF_LIFE_STEPS:.0f} steps in each engine).",
        value=float(decode.steps.w),
    )
    err = GaugeMetricFamily(
        "sluice_decode_cost_rel_rmse",
        "Relative RMS error over the served decode steps of the balancer's model, of the refit of "
        "all three terms, and of the model placement started from (a profiled table's fit or the default).",
        labels=["model"],
    )
    if decode.steps.w > 0:
        err.add_metric(["placement"], decode.steps.rel_rmse(decode.decode_cost))
        err.add_metric(["refit"], decode.steps.rel_rmse(refitted))
        err.add_metric(["prior"], decode.steps.rel_rmse(decode.prior))
    yield err


MAX_GROUP_RESTARTS = 3  # as an EP=1 engine actor's max_restarts: a crash loop stays down
SUPERVISE_EVERY_S = 0.25


@dataclass
class _EPInstance:
    """One EP instance: its placement group, rank names, and the actors and replicas of its
    ranks (replaced together when the group restarts)."""

    role: str
    pool: PoolConfig
    pg: Any
    names: list[str]
    rendezvous: Any = None  # the RendezvousActor its ranks meet through
    actors: list[Any] = field(default_factory=list)
    replicas: list[RayEngineReplica] = field(default_factory=list)
    restarts: int = 0
