"""The cluster plan: what each component of a deployment gets from its cluster spec.

``derive(spec) -> ClusterPlan`` turns a valid spec (``services.ray.cluster_spec``) into every
component's config, pure (no processes, sockets or Ray): per pool (prefill, decode) the
``EngineConfig`` fields of each instance, its layout (instances x EP ranks, Ray resources per
rank) and its ``EplbConfig``; the vision pool's layout; the router's ``RouterAdapterConfig``;
the store (node ids, k+m, directory, TTLs, capacity per node, and the ``kvstore.spec.StoreSpec``
once nodes listen); the ``ApiConfig`` limits; the ``HandoffConfig``. Spec fields nothing reads
yet are listed, with the reason, in ``UNUSED_FIELDS`` (``ClusterPlan.unused``). ``sluice serve
--config FILE --check`` prints the plan (``ClusterPlan.summary``).

``services.ray.cluster_spec`` re-exports this module's public names, so it imports this one:
the spec classes are imported here for type checking only, never at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

# For type checking only: the spec (``services.ray.cluster_spec`` imports this module, so a
# run-time import would be circular) and the component configs (imported where they are built).
if TYPE_CHECKING:
    from engine.engine_config import EngineConfig
    from kvstore.spec import StoreSpec as KvStoreSpec
    from services.api.config import ApiConfig
    from services.eplb.controller import EplbConfig
    from services.ray.cluster_spec import ClusterSpec, PoolSpec, VisionPoolSpec
    from services.ray.handoff import HandoffConfig
    from services.routing.adapter import RouterAdapterConfig

PREFILL_CACHE_EVENTS = 65_536  # prefix-cache events a prefill engine buffers for the router
DC_LABEL_SHARE = 0.001  # each rank's share of its host's ``dc:<name>`` label resource (1 per host)

# Spec fields that no component reads yet, each with the reason (none today: a field
# without a consumer is removed instead). ``derive`` consumes every field;
# tests/unit/services/test_cluster_check.py pins this list.
UNUSED_FIELDS: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PoolLayout:
    """Where one pool runs: ``instances`` engines of ``expert_parallel`` ranks each, every
    rank placed by Ray with ``resources_per_rank`` (GPU pools: ``GPU`` and the pool's custom
    resource per GPU; CPU pools: one CPU and one unit of the pool's resource)."""

    pool: str
    instances: int
    expert_parallel: int
    gpus_per_rank: int  # 0: a CPU pool
    datacenter: str
    resources_per_rank: Mapping[str, float]

    @property
    def ranks(self) -> int:
        return self.instances * self.expert_parallel

    @property
    def gpus(self) -> int:
        return self.ranks * self.gpus_per_rank

    def resources(self) -> dict[str, float]:
        """What the whole pool asks of the cluster."""
        return {k: round(v * self.ranks, 6) for k, v in self.resources_per_rank.items()}

    def describe(self) -> str:
        where = (
            f"{self.gpus} GPUs ({self.gpus_per_rank} per rank)" if self.gpus else f"{self.ranks} CPU ranks"
        )
        return f"{self.instances} instance(s) x EP {self.expert_parallel} = {self.ranks} ranks, {where}"


@dataclass(frozen=True)
class PoolPlan:
    """One engine pool: its layout, the ``EngineConfig`` fields each instance gets and its EPLB."""

    layout: PoolLayout
    engine: Mapping[str, Any]  # EngineConfig keyword arguments (``model`` is the spec's)
    eplb: EplbConfig

    def engine_config(
        self, model: str | Path | None = None, kv_store: str | Path | None = None
    ) -> EngineConfig:
        """The ``EngineConfig`` of one instance. ``model`` replaces the spec's path (a host
        where the checkpoint lives elsewhere); ``kv_store`` is the store spec file written
        from ``ClusterPlan.store.store_spec``. Raises ValueError as ``EngineConfig`` does
        (the checkpoint directory must exist here)."""
        from engine.engine_config import EngineConfig

        kwargs = dict(self.engine)
        if model is not None:
            kwargs["model"] = str(model)
        if kv_store is not None:
            kwargs["kv_store"] = str(kv_store)
        return EngineConfig(**kwargs)


@dataclass(frozen=True)
class StorePlan:
    """The KV store: its nodes, code, directory and retention."""

    node_ids: tuple[str, ...]
    k: int
    m: int
    # the spec's redis_url; "" in local-cluster mode without one (the launcher starts a Redis
    # on loopback), "memory" in embedded mode without one (one process only)
    directory: str
    ttl_s: Mapping[str, float]
    node_capacity_bytes: int  # the spec's capacity_bytes spread over the nodes
    resources_per_node: Mapping[str, float]

    def store_spec(self, addresses: Sequence[str], directory: str | None = None) -> KvStoreSpec:
        """The ``kvstore.spec.StoreSpec`` once each node listens (``addresses[i]`` is
        ``node_ids[i]``'s host:port); ``directory`` replaces the plan's (the Redis a
        local-cluster launcher started)."""
        from kvstore.placement import NodeAddress
        from kvstore.spec import StoreSpec as KvSpec

        if len(addresses) != len(self.node_ids):
            raise ValueError(f"the store has {len(self.node_ids)} nodes, got {len(addresses)} addresses")
        nodes = tuple(NodeAddress(n, a) for n, a in zip(self.node_ids, addresses))
        return KvSpec(
            nodes=nodes, directory=directory or self.directory, k=self.k, m=self.m, ttl_s=self.ttl_s
        )

    def describe(self) -> str:
        from kvstore.spec import redacted

        ttl = ", ".join(f"{c} {int(s)}s" for c, s in sorted(self.ttl_s.items()))
        return (
            f"{len(self.node_ids)} nodes, {self.k}+{self.m}, {_gib(self.node_capacity_bytes)} per node, "
            f"directory {redacted(self.directory) if self.directory else 'a Redis started on loopback'}, TTL {ttl}"
        )


@dataclass(frozen=True)
class ClusterPlan:
    """Everything a launcher needs from a ``ClusterSpec``, derived by ``derive``; pure data."""

    mode: str
    model: str
    api: ApiConfig
    vision: PoolLayout
    prefill: PoolPlan
    decode: PoolPlan
    router: RouterAdapterConfig
    store: StorePlan
    handoff: HandoffConfig
    api_replicas: int = 1  # API processes on the port (each with api's limits)
    unused: tuple[tuple[str, str], ...] = UNUSED_FIELDS

    def resources(self) -> dict[str, float]:
        """Ray resources the whole deployment asks for (engines, vision encoders, store nodes);
        the per-host ``dc:<name>`` labels are left out (each rank takes a share of its host's)."""
        total: dict[str, float] = {}
        parts = [self.vision.resources(), self.prefill.layout.resources(), self.decode.layout.resources()]
        parts.append({k: v * len(self.store.node_ids) for k, v in self.store.resources_per_node.items()})
        for part in parts:
            for k, v in part.items():
                if k.startswith("dc:") or not v:
                    continue
                total[k] = round(total.get(k, 0.0) + v, 6)
        return total

    def summary(self) -> list[str]:
        """Readable lines for ``sluice serve --config FILE --check``."""
        lines = [f"mode {self.mode}, model {self.model or '(the default preset)'}"]
        lines.append(
            f"api: {self.api.host}:{self.api.port}, {self.api_replicas} process(es), each max_concurrency "
            f"{self.api.max_concurrency}, max_queue {self.api.max_queue}"
        )
        for pool in (self.prefill, self.decode):
            lay, eng = pool.layout, pool.engine
            lines.append(f"{lay.pool} pool (datacenter {lay.datacenter}): {lay.describe()}")
            lines.append(
                f"  engine: device {eng['device']}, dtype {eng['dtype']}, max_num_seqs {eng['max_num_seqs']}, "
                f"max_num_batched_tokens {eng['max_num_batched_tokens']}"
            )
            lines.append(f"  resources per rank: {_fmt(lay.resources_per_rank)}")
            e = pool.eplb
            lines.append(
                f"  eplb: {'on' if e.enabled else 'off'}, {e.algorithm}, {e.num_redundant_per_rank} redundant "
                f"per rank, window {e.window_steps} / period {e.period_steps} steps"
            )
        if self.vision.instances:
            lines.append(f"vision pool (datacenter {self.vision.datacenter}): {self.vision.describe()}")
        lines.append(
            f"router: policy {self.router.policy} over {self.router.num_prefill} prefill and "
            f"{self.router.num_decode} decode instance(s)"
        )
        lines.append(f"store: {self.store.describe()}")
        h = self.handoff
        lines.append(
            f"handoff: {h.transport}"
            + (
                f" (servers on {h.host}, {_gib(h.max_held_bytes)} / {h.ttl_s:g} s held per prefill engine, "
                f"link {h.link_gbps:g} Gbit/s)"
                if h.transport == "grpc"
                else ""
            )
        )
        gpus = self.vision.gpus + self.prefill.layout.gpus + self.decode.layout.gpus
        lines.append(f"needs: {gpus} GPUs; Ray resources {_fmt(self.resources())}")
        lines.append("unused spec fields:" if self.unused else "unused spec fields: none")
        lines += [f"  {name}: {why}" for name, why in self.unused]
        return lines


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _layout(pool: str, resource: str, spec: PoolSpec | VisionPoolSpec, mode: str) -> PoolLayout:
    ep, gpus = getattr(spec, "expert_parallel", 1), spec.gpus_per_replica
    if gpus and gpus % ep:
        raise ValueError(
            f"{pool}: gpus_per_replica ({gpus}) must be a multiple of expert_parallel ({ep}): "
            f"each of the {ep} ranks of an instance gets the same GPUs"
        )
    per_rank = gpus // ep
    resources: dict[str, float] = {"GPU": per_rank, resource: per_rank} if gpus else {"CPU": 1, resource: 1}
    if mode == "two-datacenters":  # hosts advertise dc:<name>: 1 (deploy/ray/cluster.yaml)
        resources[f"dc:{spec.datacenter}"] = DC_LABEL_SHARE
    return PoolLayout(pool, spec.replicas, ep, per_rank, spec.datacenter, resources)


def _engine_fields(
    spec: ClusterSpec, layout: PoolLayout, pool: PoolSpec, **pool_fields: Any
) -> dict[str, Any]:
    from engine.engine_config import EngineConfig

    gpu = layout.gpus_per_rank > 0
    fields: dict[str, Any] = {
        "model": spec.model,
        "device": "cuda" if gpu else "cpu",
        "dtype": "bfloat16" if gpu else "float32",
        "swa_replay": spec.swa_replay,
        "host_swa_bytes": pool.host_swa_bytes,
        "host_swa_format": pool.host_swa_format,
        "host_swa_layers": pool.host_swa_layers,
        "keep_quantized": pool.fp8_weights != "dequantize",
        "fp8_compute": "w8a8" if pool.fp8_weights == "w8a8" else "w8a16",
        **pool_fields,
    }
    seqs = fields.get("max_num_seqs", EngineConfig.max_num_seqs)
    fields["max_num_seqs"] = seqs
    fields["num_swa_slots"] = max(EngineConfig.num_swa_slots, seqs)  # EngineConfig needs one per sequence
    fields.setdefault("max_num_batched_tokens", EngineConfig.max_num_batched_tokens)
    return fields


def derive(spec: ClusterSpec) -> ClusterPlan:
    """The concrete configs of every component of ``spec``: engines per pool, router, store,
    API. Pure (no processes, sockets or Ray); ValueError for a spec that validates field by
    field but cannot be deployed (an unknown router policy, GPUs that do not split into the
    EP ranks, a store code the store does not support, no shared directory where engines
    run in several processes)."""
    _check_deployable(spec)
    prefill_layout = _layout("prefill", "prefill", spec.prefill, spec.mode)
    decode_layout = _layout("decode", "decode", spec.decode, spec.mode)
    vision = _layout("vision", "ve", spec.vision, spec.mode)
    prefill = _prefill_plan(spec, prefill_layout)
    decode = _decode_plan(spec, decode_layout)
    store = _store(spec)
    router = _router(spec, prefill_layout, decode_layout)
    api = _api(spec)
    return ClusterPlan(
        spec.mode, spec.model, api, vision, prefill, decode, router, store, _handoff(spec), spec.api.replicas
    )


def _check_deployable(spec: ClusterSpec) -> None:
    """The checks across sections: both pools present, FP8 activations on both or neither,
    a shared store directory where engines run on several hosts."""
    for name, pool in (("prefill", spec.prefill), ("decode", spec.decode)):
        if pool.replicas < 1:
            raise ValueError(f"{name}.replicas must be >= 1: the router needs a {name} instance to route to")
    if (spec.prefill.fp8_weights == "w8a8") != (spec.decode.fp8_weights == "w8a8"):
        raise ValueError(
            "prefill.fp8_weights and decode.fp8_weights must both be w8a8 or both not: FP8-quantised "
            "activations compute other caches, and a handoff carries a cache between the two pools"
        )
    if spec.mode not in ("embedded", "local-cluster") and not spec.redis_url:
        raise ValueError(
            f"mode {spec.mode} runs engines on several hosts, so the store's directory must be shared: "
            "set redis_url"
        )


def _prefill_plan(spec: ClusterSpec, layout: PoolLayout) -> PoolPlan:
    """The prefill pool: chunks of ``chunk_token_budget`` tokens, cache events for the router."""
    from services.eplb.controller import EplbConfig

    fields = _engine_fields(
        spec,
        layout,
        spec.prefill,
        max_num_batched_tokens=spec.prefill.chunk_token_budget,
        cache_event_capacity=PREFILL_CACHE_EVENTS,
    )
    return PoolPlan(
        layout, MappingProxyType(fields), EplbConfig.from_cluster_spec("prefill", spec.prefill.eplb)
    )


def _decode_plan(spec: ClusterSpec, layout: PoolLayout) -> PoolPlan:
    """The decode pool: ``max_running_requests`` sequences, speculative decoding if set."""
    from services.eplb.controller import EplbConfig

    fields = _engine_fields(
        spec,
        layout,
        spec.decode,
        max_num_seqs=spec.decode.max_running_requests,
        speculative=spec.decode.speculative,
        spec_profile_path=spec.decode.spec_profile,
    )
    return PoolPlan(
        layout, MappingProxyType(fields), EplbConfig.from_cluster_spec("decode", spec.decode.eplb)
    )


def _store(spec: ClusterSpec) -> StorePlan:
    """The store's plan, checked by the store itself (code limits, traffic classes,
    directory URL) as if its nodes listened on loopback."""
    st = spec.store
    store = StorePlan(
        node_ids=tuple(f"n{i:02d}" for i in range(st.nodes)),  # as kvstore.cluster names them
        k=st.data_shards,
        m=st.parity_shards,
        directory=spec.redis_url or ("" if spec.mode == "local-cluster" else "memory"),
        ttl_s=MappingProxyType({c: float(s) for c, s in st.ttl_seconds.items()}),
        node_capacity_bytes=max(1, st.capacity_bytes // st.nodes),
        resources_per_node=MappingProxyType({"store": 1}),
    )
    try:
        store.store_spec([f"127.0.0.1:{7000 + i}" for i in range(st.nodes)], store.directory or "memory")
    except ValueError as exc:
        raise ValueError(f"store: {exc}") from None
    return store


def _router(spec: ClusterSpec, prefill: PoolLayout, decode: PoolLayout) -> RouterAdapterConfig:
    """The router over the pools' instances; ValueError naming ``router_policy``."""
    from services.routing.adapter import RouterAdapterConfig

    try:
        return RouterAdapterConfig(
            policy=spec.router_policy,
            num_prefill=prefill.instances,
            num_decode=decode.instances,
            # the router's view of the store is a bounded hint: as many blocks as the prefill
            # engines keep for it to drain (as services.routing.client)
            store_capacity_blocks=prefill.instances * PREFILL_CACHE_EVENTS,
        )
    except ValueError as exc:
        raise ValueError(f"router_policy: {exc}") from None


def _api(spec: ClusterSpec) -> ApiConfig:
    """Each API process's socket and admission limits."""
    from services.api.config import ApiConfig

    return ApiConfig(
        host=spec.api.host,
        port=spec.api.port,
        max_concurrency=spec.api.max_concurrency,
        max_queue=spec.api.max_queue,
    )


def _handoff(spec: ClusterSpec) -> HandoffConfig:
    """The handoff transport: ``auto`` is gRPC exactly when the pools are in two datacentres;
    the fetch deadline uses the declared link between them (else the default rate)."""
    from services.ray.handoff import HandoffConfig

    h = spec.handoff
    transport = h.transport
    if transport == "auto":
        transport = "grpc" if spec.prefill.datacenter != spec.decode.datacenter else "object_store"
    gbps = spec.link_gbps(spec.prefill.datacenter, spec.decode.datacenter)
    kwargs: dict[str, Any] = {} if gbps is None else {"link_gbps": gbps}
    return HandoffConfig(transport, h.bind_host, h.max_held_bytes, h.ttl_seconds, **kwargs)
