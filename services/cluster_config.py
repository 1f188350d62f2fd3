"""The cluster spec: the one YAML file that describes a Sluice deployment.

Pydantic lives only at this edge (CONVENTIONS 9). Unknown keys, conflicting settings and
out-of-range values are rejected with a message naming the field, so a typo never turns
into a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


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


class ApiSpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_concurrency: int = Field(default=64, ge=1)
    max_queue: int = Field(default=256, ge=0)


class ClusterSpec(_Strict):
    """The whole deployment. ``mode`` picks the shape (docs/architecture.md, deployment shapes)."""

    mode: Literal["embedded", "local-cluster", "ray-cluster", "two-datacenters"] = "embedded"
    model: str = ""
    redis_url: str = ""
    router_policy: str = "sluice"
    api: ApiSpec = Field(default_factory=ApiSpec)
    vision: PoolSpec = Field(default_factory=lambda: PoolSpec(replicas=0))
    prefill: PrefillPoolSpec = Field(default_factory=PrefillPoolSpec)
    decode: DecodePoolSpec = Field(default_factory=DecodePoolSpec)
    store: StoreSpec = Field(default_factory=StoreSpec)
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
        return self


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
