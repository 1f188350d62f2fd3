"""The cluster spec: the one YAML file that describes a Sluice deployment.

Pydantic lives only at this edge (CONVENTIONS 9). Unknown keys, conflicting settings and
out-of-range values are rejected with a message naming the field, so a typo never turns
into a silently ignored setting.

``derive(spec) -> ClusterPlan`` turns a valid spec into every component's config, pure (no
processes, sockets or Ray): per pool (prefill, decode) the ``EngineConfig`` fields of each
instance, its layout (instances x EP ranks, Ray resources per rank) and its ``EplbConfig``;
the vision pool's layout; the router's ``RouterAdapterConfig``; the store (node ids, k+m,
directory, TTLs, capacity per node, and the ``kvstore.spec.StoreSpec`` once nodes listen);
the ``ApiConfig`` limits. Spec fields nothing reads yet are listed, with the reason, in
``UNUSED_FIELDS`` (``ClusterPlan.unused``). ``sluice serve --config FILE --check`` prints
the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:  # the plan's component configs; imported where they are built
    from engine.engine_config import EngineConfig
    from kvstore.spec import StoreSpec as KvStoreSpec
    from services.api.config import ApiConfig
    from services.eplb.controller import EplbConfig
    from services.ray.handoff import HandoffConfig
    from services.routing.adapter import RouterAdapterConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EplbSpec(_Strict):
    """Expert-parallel load balancing for one pool (DeepSeek's settings are the defaults)."""

    enabled: bool = True
    redundant_experts_per_gpu: int = Field(ge=0, le=64)
    window_steps: int = Field(ge=1)
    period_steps: int = Field(ge=1)
    algorithm: str = "sluice"
    min_gain: float = Field(default=0.0, ge=0)  # skip a re-placement that improves imbalance less
    layers_per_step: int = Field(default=1, ge=1)  # layers whose weights move per engine step
    num_groups: int = Field(default=1, ge=1)  # expert groups for hierarchical placement
    gpus_per_node: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _window_within_period(self) -> EplbSpec:
        if self.window_steps > self.period_steps:
            raise ValueError(
                f"window_steps ({self.window_steps}) must not exceed period_steps ({self.period_steps})"
            )
        return self


def _prefill_eplb() -> EplbSpec:
    return EplbSpec(redundant_experts_per_gpu=4, window_steps=100, period_steps=1000, algorithm="sluice")


def _decode_eplb() -> EplbSpec:
    return EplbSpec(redundant_experts_per_gpu=1, window_steps=1000, period_steps=10000, algorithm="sluice")


class PoolSpec(_Strict):
    """A pool of identical engine instances placed by Ray custom resources."""

    replicas: int = Field(default=1, ge=0)
    gpus_per_replica: int = Field(default=0, ge=0)
    expert_parallel: int = Field(default=1, ge=1)
    datacenter: str = "a"
    # per engine: a host-memory pool of the sliding-window slots of ended turns (0: off)
    host_swa_bytes: int = Field(default=0, ge=0)
    host_swa_format: Literal["native", "mxfp8"] = "native"
    host_swa_layers: int | None = Field(default=None, ge=1)  # None: every layer's window (exact)
    # an FP8 checkpoint's weights: "dequantize" (bf16 copies at load), or kept FP8 on the
    # device (half the weight memory) times bf16 activations ("w8a16") or FP8-quantised
    # ones ("w8a8", other numerics: docs/engine.md, "FP8 activations")
    fp8_weights: Literal["dequantize", "w8a16", "w8a8"] = "dequantize"


class VisionPoolSpec(_Strict):
    """The vision encoders: dense (no experts to shard) and without a KV cache, so only
    their count, GPUs and datacentre."""

    replicas: int = Field(default=0, ge=0)
    gpus_per_replica: int = Field(default=0, ge=0)
    datacenter: str = "a"


class PrefillPoolSpec(PoolSpec):
    eplb: EplbSpec = Field(default_factory=_prefill_eplb)
    chunk_token_budget: int = Field(default=32768, ge=256)

    @model_validator(mode="after")
    def _ep_range(self) -> PrefillPoolSpec:
        if self.gpus_per_replica and not 1 <= self.expert_parallel <= 8:
            raise ValueError(f"prefill expert_parallel must be 1..8 on GPUs, got {self.expert_parallel}")
        return self


class DecodePoolSpec(PoolSpec):
    eplb: EplbSpec = Field(default_factory=_decode_eplb)
    max_running_requests: int = Field(default=256, ge=1)
    # speculative decoding in the decode engines (EngineConfig.speculative: "dspark",
    # "dspark-lagged", "fixed-K[:N]"); None: off. Needs expert_parallel 1.
    speculative: str | None = None

    @model_validator(mode="after")
    def _speculation(self) -> DecodePoolSpec:
        if self.speculative is not None:
            from engine.spec.policy import SpecConfig

            SpecConfig.parse(self.speculative)
            if self.expert_parallel > 1:
                raise ValueError(
                    "decode.speculative needs expert_parallel 1: an EP group's ranks run their MoE "
                    "all-to-all in lockstep, and their drafting passes differ from rank to rank"
                )
        return self


class StoreSpec(_Strict):
    data_shards: int = Field(default=10, ge=1, le=64)
    parity_shards: int = Field(default=2, ge=0, le=16)
    nodes: int = Field(default=12, ge=1)
    capacity_bytes: int = Field(default=64 * 2**30, ge=1)
    ttl_seconds: dict[str, int] = Field(default_factory=lambda: {"agent": 3 * 86400, "chat": 7 * 86400})

    @model_validator(mode="after")
    def _enough_nodes(self) -> StoreSpec:
        if self.nodes < self.data_shards + self.parity_shards:
            raise ValueError(
                f"store needs at least data_shards + parity_shards = "
                f"{self.data_shards + self.parity_shards} nodes, got {self.nodes}"
            )
        return self


class HandoffSpec(_Strict):
    """How handoff payloads travel from prefill to decode engines (services/ray/handoff.py):
    ``auto`` is Ray's object store when both pools are in one datacentre and gRPC between
    datacentres (a connection per engine pair, a deadline from ``interconnect_gbps``)."""

    transport: Literal["auto", "object_store", "grpc"] = "auto"
    bind_host: str = "127.0.0.1"  # the prefill engines' gRPC servers; 0.0.0.0 advertises the node's IP
    max_held_bytes: int = Field(default=4 * 2**30, ge=1)  # per prefill engine (gRPC)
    ttl_seconds: float = Field(default=600.0, gt=0)


class ApiSpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # API processes sharing the port, each with its own router over the same engines
    replicas: int = Field(default=1, ge=1, le=64)
    max_concurrency: int = Field(default=64, ge=1)
    max_queue: int = Field(default=256, ge=0)


class ClusterSpec(_Strict):
    """The whole deployment. ``mode`` picks the shape (docs/architecture.md, deployment shapes)."""

    mode: Literal["embedded", "local-cluster", "ray-cluster", "two-datacenters"] = "embedded"
    model: str = ""
    redis_url: str = ""
    router_policy: str = "sluice"
    # A prefix hit whose sliding-window state is gone, for requests that do not choose:
    # "exact" replay (output unchanged) or "bounded" (window - 1 tokens, approximate)
    swa_replay: Literal["exact", "bounded"] = "exact"
    api: ApiSpec = Field(default_factory=ApiSpec)
    vision: VisionPoolSpec = Field(default_factory=VisionPoolSpec)
    prefill: PrefillPoolSpec = Field(default_factory=PrefillPoolSpec)
    decode: DecodePoolSpec = Field(default_factory=DecodePoolSpec)
    store: StoreSpec = Field(default_factory=StoreSpec)
    handoff: HandoffSpec = Field(default_factory=HandoffSpec)
    # link rate between datacentres, "a-b": Gbit/s (either order); sets the handoff deadline
    interconnect_gbps: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shape_is_consistent(self) -> ClusterSpec:
        if self.mode == "ray-cluster" and not self.redis_url:
            raise ValueError("mode ray-cluster needs redis_url: store metadata must be shared by all hosts")
        dcs = {self.prefill.datacenter, self.decode.datacenter}
        if self.mode == "two-datacenters" and len(dcs) != 2:
            raise ValueError("mode two-datacenters needs prefill and decode in different datacenters")
        if self.mode != "two-datacenters" and len(dcs) != 1:
            raise ValueError(
                f"prefill and decode are in different datacenters {sorted(dcs)}: set mode two-datacenters"
            )
        known = dcs | {self.vision.datacenter}
        for link, gbps in self.interconnect_gbps.items():
            ends = link.split("-")
            if len(ends) != 2 or not set(ends) <= known or ends[0] == ends[1]:
                raise ValueError(
                    f"interconnect_gbps: {link!r} is not 'x-y' for two of this spec's datacenters {sorted(known)}"
                )
            if gbps <= 0:
                raise ValueError(f"interconnect_gbps: {link!r} must be > 0 Gbit/s, got {gbps}")
        return self

    def link_gbps(self, a: str, b: str) -> float | None:
        """The declared rate between datacentres ``a`` and ``b`` (either order), if any."""
        return self.interconnect_gbps.get(f"{a}-{b}", self.interconnect_gbps.get(f"{b}-{a}"))


def load_cluster_spec(path: Path | str) -> ClusterSpec:
    """Parse and validate a cluster YAML; raises ValueError naming every bad field."""
    text = Path(path).read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the cluster spec must be a mapping at the top level")
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{path}: invalid cluster spec: {problems}") from None


# -- the plan: what each component gets from the spec -----------------------------------------

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
    from services.api.config import ApiConfig
    from services.eplb.controller import EplbConfig
    from services.routing.adapter import RouterAdapterConfig

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
    prefill_layout = _layout("prefill", "prefill", spec.prefill, spec.mode)
    decode_layout = _layout("decode", "decode", spec.decode, spec.mode)
    vision = _layout("vision", "ve", spec.vision, spec.mode)
    prefill = PoolPlan(
        prefill_layout,
        MappingProxyType(
            _engine_fields(
                spec,
                prefill_layout,
                spec.prefill,
                max_num_batched_tokens=spec.prefill.chunk_token_budget,
                cache_event_capacity=PREFILL_CACHE_EVENTS,
            )
        ),
        EplbConfig.from_cluster_spec("prefill", spec.prefill.eplb),
    )
    decode = PoolPlan(
        decode_layout,
        MappingProxyType(
            _engine_fields(
                spec,
                decode_layout,
                spec.decode,
                max_num_seqs=spec.decode.max_running_requests,
                speculative=spec.decode.speculative,
            )  # fmt: skip
        ),
        EplbConfig.from_cluster_spec("decode", spec.decode.eplb),
    )
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
    try:  # the store's own checks (code limits, traffic classes, directory URL)
        store.store_spec([f"127.0.0.1:{7000 + i}" for i in range(st.nodes)], store.directory or "memory")
    except ValueError as exc:
        raise ValueError(f"store: {exc}") from None
    try:
        router = RouterAdapterConfig(
            policy=spec.router_policy,
            num_prefill=prefill_layout.instances,
            num_decode=decode_layout.instances,
            # the router's view of the store is a bounded hint: as many blocks as the prefill
            # engines keep for it to drain (as services.routing.client)
            store_capacity_blocks=prefill_layout.instances * PREFILL_CACHE_EVENTS,
        )
    except ValueError as exc:
        raise ValueError(f"router_policy: {exc}") from None
    api = ApiConfig(
        host=spec.api.host,
        port=spec.api.port,
        max_concurrency=spec.api.max_concurrency,
        max_queue=spec.api.max_queue,
    )
    return ClusterPlan(
        spec.mode, spec.model, api, vision, prefill, decode, router, store, _handoff(spec), spec.api.replicas
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
