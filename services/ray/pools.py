"""The engine actors of a deployment's pools: ``PoolConfig`` and ``PoolActors``.

``PoolConfig`` describes one pool (prefill, decode or vision). ``PoolActors`` owns the Ray
actors of one deployment, for ``RayServingClient``:

* **names**: each actor is registered as ``sluice-{deployment}-{engine}`` (``prefill-0``;
  ``decode-1.0``: instance 1, rank 0; ``vision-0``), so the API replicas of a deployment
  (``attach``) find the engines another process started, and follow them;
* **making**: a model instance is one ``EngineActor``, or with ``expert_parallel`` > 1 one
  per EP rank in a placement group, the ranks meeting through a rendezvous actor; the
  vision pool's instances are ``VisionActor``s (``services.ray.vision``);
* **supervision**: an EP instance with a rank down is restarted whole (``supervise``);
* **close**: the actors made here stop, with the EP instances' rendezvous actors and
  placement groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.ray.handoff import HandoffConfig
from services.ray.replica import RayEngineReplica

log = logging.getLogger("services.ray.serving")  # the EP supervisor's lines, beside the serving client's

MAX_GROUP_RESTARTS = 3  # as an EP=1 engine actor's max_restarts: a crash loop stays down
SUPERVISE_EVERY_S = 0.25


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


class PoolActors:
    """The actors of deployment ``deployment``: made here, each engine loading
    ``checkpoint`` with ``handoff`` (``services.ray.handoff``), or with ``attach`` found
    (within ``start_timeout_s``) among those another process made. ``vision_pool``: the
    vision pool's config (None: the engines encode their images). ``actors``: every actor
    made here, which ``close`` stops."""

    def __init__(
        self,
        checkpoint: Path,
        deployment: str,
        *,
        attach: bool,
        handoff: HandoffConfig,
        vision_pool: PoolConfig | None,
        start_timeout_s: float,
    ) -> None:
        self.checkpoint, self.deployment, self.attach = checkpoint, deployment, attach
        self.handoff, self.vision_pool, self.start_timeout_s = handoff, vision_pool, start_timeout_s
        self.actors: list[Any] = []
        self._groups: list[_EPInstance] = []  # the EP instances (expert_parallel > 1)
        self._supervisor: asyncio.Task[None] | None = None

    # -- actor names: API replicas find the engines another process started ------------------
    @staticmethod
    def _engine_names(role: str, index: int, pool: PoolConfig) -> list[str]:
        if pool.expert_parallel == 1:
            return [f"{role}-{index}"]
        return [f"{role}-{index}.{rank}" for rank in range(pool.expert_parallel)]

    def actor_name(self, engine: str) -> str:
        """The Ray actor name of ``engine`` (``prefill-0``, ``decode-1.0``) in this deployment."""
        return f"sluice-{self.deployment}-{engine}"

    def lookup(self, engine: str) -> Any:
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

    # -- making the actors -------------------------------------------------------------------
    def _actor_config(self, pool: PoolConfig) -> dict[str, Any]:
        """An engine actor's configuration: its pool's, and with a vision pool no encoder of
        its own (the pool encodes every image; the engine only verifies the rows it is sent)."""
        return {**pool.engine_config, **({"encode_images": False} if self.vision_pool else {})}

    async def instance(self, role: str, index: int, pool: PoolConfig) -> list[tuple[Any, str]]:
        """The actors of model instance ``index`` of ``role``'s pool, with their engine names:
        found when attached, else made (``_make``)."""
        names = self._engine_names(role, index, pool)
        if self.attach:
            return [(await self._find(n), n) for n in names]
        return self._make(role, names, pool)

    def _make(self, role: str, names: list[str], pool: PoolConfig) -> list[tuple[Any, str]]:
        """The actors of one model instance: one engine, or one per EP rank in a placement
        group (``PACK``: as few nodes as hold it, one when it fits) whose ranks meet through
        a rendezvous actor (``services.ray.rendezvous``), wherever they run."""
        from services.ray.actors import remote_engine_actor

        opts: dict[str, Any] = {"num_cpus": pool.num_cpus, "resources": dict(pool.resources)}
        if pool.expert_parallel == 1:
            (name,) = names
            actor = remote_engine_actor(
                role, str(self.checkpoint), self._actor_config(pool), pool_resource=False,
                handoff=asdict(self.handoff), name=self.actor_name(name), **opts,
            )  # fmt: skip
            self.actors.append(actor)
            return [(actor, name)]
        from ray.util.placement_group import placement_group

        bundle = {**dict(pool.resources), **({"CPU": pool.num_cpus} if pool.num_cpus else {})}
        pg = placement_group([dict(bundle) for _ in range(pool.expert_parallel)], strategy="PACK")
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

    async def vision_actors(self, front: Mapping[str, Any]) -> list[tuple[Any, str]]:
        """The vision pool's actors and names (made here, or found when attached); unless the
        pool's ``engine_config`` sets them, they run on the ``device`` and ``dtype`` of
        ``front`` (the prefill engines' config: the dtype rows travel in)."""
        pool = self.vision_pool
        if pool is None:
            return []
        names = [f"vision-{i}" for i in range(pool.engines)]
        if self.attach:
            return [(await self._find(n), n) for n in names]
        from services.ray.vision import DEFAULT_CACHE_BYTES, remote_vision_actor

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

    # -- supervision of EP instances ---------------------------------------------------------
    def supervise(self, replicas: Mapping[str, RayEngineReplica]) -> None:
        """Give each EP instance its ranks' replicas (``replicas``: by engine name) and, for
        instances made here, start the supervisor (``_supervise``)."""
        for inst in self._groups:
            inst.replicas = [replicas[n] for n in inst.names]
        if self._groups and not self.attach:
            self._supervisor = asyncio.create_task(self._supervise(), name="sluice-ep-supervisor")

    async def stop_supervising(self) -> None:
        """Stop the supervisor, if one runs (the client does first when it closes)."""
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
            self._supervisor = None

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
        """Stop the actors made here (each closes its engine first, 30 s for all), the EP
        instances' rendezvous actors and placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

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
        self.actors, self._groups = [], []
