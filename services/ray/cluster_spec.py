"""The cluster spec: the one YAML file that describes a Sluice deployment.

Pydantic lives only at this edge (CONVENTIONS 9). Unknown keys, conflicting settings and
out-of-range values are rejected with a message naming the field, so a typo never turns
into a silently ignored setting.

What each component gets from a valid spec, ``derive(spec) -> ClusterPlan``, lives in
``services.ray.cluster_plan``; its public names are re-exported here (``__all__``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.ray.cluster_plan import (
    DC_LABEL_SHARE,
    PREFILL_CACHE_EVENTS,
    UNUSED_FIELDS,
    ClusterPlan,
    PoolLayout,
    PoolPlan,
    StorePlan,
    derive,
)

# the spec, and the plan's names that moved to cluster_plan.py, still imported from here
__all__ = [
    "DC_LABEL_SHARE",
    "PREFILL_CACHE_EVENTS",
    "UNUSED_FIELDS",
    "ApiSpec",
    "ClusterPlan",
    "ClusterSpec",
    "DecodePoolSpec",
    "EplbSpec",
    "HandoffSpec",
    "PoolLayout",
    "PoolPlan",
    "PoolSpec",
    "PrefillPoolSpec",
    "StorePlan",
    "StoreSpec",
    "VisionPoolSpec",
    "derive",
    "load_cluster_spec",
]


class _Strict(BaseModel):
    """Every section of a cluster file: an unknown key is an error (a misspelt setting never
    silently falls back to its default), and a parsed spec is immutable."""

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
    """The prefill engines: expert parallel 1-8 on GPUs, and the token budget of one step's
    prompt chunks."""

    eplb: EplbSpec = Field(default_factory=_prefill_eplb)
    chunk_token_budget: int = Field(default=32768, ge=256)

    @model_validator(mode="after")
    def _ep_range(self) -> PrefillPoolSpec:
        if self.gpus_per_replica and not 1 <= self.expert_parallel <= 8:
            raise ValueError(f"prefill expert_parallel must be 1..8 on GPUs, got {self.expert_parallel}")
        return self


class DecodePoolSpec(PoolSpec):
    """The decode engines: how many requests each runs at once, and their speculative
    decoding (off unless set)."""

    eplb: EplbSpec = Field(default_factory=_decode_eplb)
    max_running_requests: int = Field(default=256, ge=1)
    # speculative decoding in the decode engines (EngineConfig.speculative: "dspark",
    # "dspark-lagged", "fixed-K[:N]"); None: off. Each EP rank chooses its own drafts; their
    # MTP passes are matched (engine.distributed.lockstep.DraftLockstep).
    speculative: str | None = None
    # the step profile DSpark schedules by (EngineConfig.spec_profile_path), a path on the
    # decode hosts; None: the one measured beside the checkpoint for the engine's device. An
    # EP rank's own (`sluice bench spec --width-profile P --width-ep N --width-out FILE`)
    # prices a verified token by the rank's compute, not by the whole model on one card.
    spec_profile: str | None = None

    @model_validator(mode="after")
    def _speculation(self) -> DecodePoolSpec:
        if self.speculative is not None:
            from engine.spec.policy import SpecConfig

            SpecConfig.parse(self.speculative)
        elif self.spec_profile is not None:
            raise ValueError("decode.spec_profile is read only with decode.speculative set")
        return self


class StoreSpec(_Strict):
    """The erasure-coded KV/prefix store: its code (10 data + 2 parity shards by default, one
    shard a node), its nodes' capacity, and how long each kind of session's prefixes live."""

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
    """The HTTP API: where it listens (loopback by default), its processes, and the requests
    it runs and queues before answering 429."""

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
