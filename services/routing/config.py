"""The settings of live routing: ``RoutingConfig`` and its ``SlotLookupConfig``, validated on construction.

``sluice serve --replicas/--router-policy`` and ``sluice bench api`` build a
``RoutingConfig`` (``ROUTER_POLICIES`` are the policy names it accepts);
``RoutedEngineClient.in_process`` (``services.routing.client``) turns it into engine
replicas behind the router. A leaf module (no engine, router or Prometheus imports), so a
config is built and checked before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

ROUTER_POLICIES = ("round_robin", "least_load", "cache_aware", "sluice")


@dataclass(frozen=True)
class SlotLookupConfig:
    """How the router finds and costs a prompt's SWA slot (docs/router.md, "SWA slots").

    A fetch costs ``slot bytes / bytes_per_s + round_trip_s`` seconds: the link between two
    engines' slot servers and one gRPC request/response over it.
    """

    bytes_per_s: float = 25e9  # a 200 Gb/s host NIC
    round_trip_s: float = 2e-4  # one request/response between hosts of a cluster
    timeout_s: float = 0.05  # a directory lookup slower than this is skipped (and counted)

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or not self.round_trip_s >= 0 or not self.timeout_s > 0:
            raise ValueError(
                f"SlotLookupConfig needs bytes_per_s > 0, round_trip_s >= 0 and timeout_s > 0, got "
                f"{self.bytes_per_s}, {self.round_trip_s}, {self.timeout_s}"
            )


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
    # with SWA slot sharing: how the router looks up and costs a prompt's slot
    slot_lookup: SlotLookupConfig = SlotLookupConfig()

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
