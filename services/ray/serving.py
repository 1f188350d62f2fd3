"""``RayServingClient``: the API's ``EngineClient`` over prefill and decode pools of Ray actors.

``start`` creates the engine actors (``EngineActor``, one per engine, placed by the pool's
Ray resources; ``PoolActors`` in ``services.ray.pools`` makes, names and supervises them),
loads them in parallel, then routes over them:

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
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.api.engine_client import EngineOutput, EngineRequest, EngineStats, EngineUnavailable, ModelInfo
from services.ray.decode_set import DecodeSet
from services.ray.handoff import HandoffConfig
from services.ray.metrics import PoolMetrics
from services.ray.pools import PoolActors, PoolConfig
from services.ray.replica import RayEngineReplica

__all__ = ["PoolConfig", "RayServingClient", "merge_decode_stats"]

log = logging.getLogger(__name__)


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
        # the vision pool: ``engines`` instances; ``engine_config`` may set its ``device``,
        # ``dtype`` (default: the prefill engines', the dtype rows travel in) and ``cache_bytes``
        self.vision_pool = vision if vision is not None and vision.engines > 0 else None
        self.vision: Any = None  # services.ray.vision.VisionPool, once started
        self._pool_actors = PoolActors(
            self.checkpoint, self.deployment, attach=attach, handoff=self.handoff,
            vision_pool=self.vision_pool, start_timeout_s=start_timeout_s,
        )  # fmt: skip
        self.prefill: list[RayEngineReplica] = []
        self.decode: DecodeSet | None = None
        self.router: Any = None  # RoutedEngineClient, once started
        self.metrics = PoolMetrics()

    @property
    def disaggregated(self) -> bool:
        return self.decode_pool.engines > 0

    @property
    def actors(self) -> list[Any]:
        """Every actor this client made (none when attached): engines, EP ranks, vision."""
        return self._pool_actors.actors

    def actor_name(self, engine: str) -> str:
        """The Ray actor name of ``engine`` (``prefill-0``, ``decode-1.0``) in this deployment."""
        return self._pool_actors.actor_name(engine)

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
                    made[role] += await self._pool_actors.instance(role, i, pool)
            every = [a for role in made.values() for a, _ in role]
            seers = await self._pool_actors.vision_actors(self.prefill_pool.engine_config)
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
                        lookup=self._pool_actors.lookup(n),
                        call_timeout_s=self.call_timeout_s,
                    )  # fmt: skip
                    for a, n in made["decode"]
                ]
                await asyncio.gather(*(r.start() for r in decode))
                self.decode = DecodeSet(
                    decode, self.decode_policy, self._fitted_decode_cost(),
                    speculating=bool(self.decode_pool.engine_config.get("speculative")),
                )  # fmt: skip
            front = "prefill" if self.disaggregated else "colocated"
            self.prefill = [
                RayEngineReplica(
                    a,
                    by_actor[id(a)],
                    self.decode,
                    name=n,
                    metrics=self.metrics,
                    lookup=self._pool_actors.lookup(n),
                    call_timeout_s=self.call_timeout_s,
                )
                for a, n in made[front]
            ]
            self.router = RoutedEngineClient(self.prefill, self.policy, self.cost or self._fitted_cost())
            await self.router.start()
            self._pool_actors.supervise({r.name: r for r in self._engines()})
        except BaseException:
            await self.close()
            raise

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

    async def close(self) -> None:
        await self._pool_actors.stop_supervising()
        if self.router is not None:
            await self.router.close()
            self.router = None
        self.vision = None
        if self.decode is not None:
            await asyncio.gather(*(r.close() for r in self.decode.replicas), return_exceptions=True)
        if self.attach:  # the engines belong to the process that started them
            self.prefill, self.decode = [], None
            return
        await self._pool_actors.close()
        self.prefill, self.decode = [], None

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
    its measured cost scales (ratios) and choice host time, per engine, averaged over the
    engines."""
    extra = dict(front.extra)
    scales: dict[str, list[float]] = {}
    for s in per:
        for k, v in s.extra.items():
            if k.startswith("spec_cost_scale_") or k == "spec_cost_host_seconds":
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
    decode steps the engines served (``costmodel.online``), and how well each predicts
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
