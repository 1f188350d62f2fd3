"""What ``RoutedEngineClient`` reports: its replicas' stats as one engine's, and the router's series.

* ``merge_stats``: the replicas' ``EngineStats`` summed into one (what the API's
  ``sluice_engine_*`` gauges read), except the per-replica means in ``MEAN_EXTRA_STATS``,
  which are averaged over the replicas that measured one (``mean_measured``);
* ``router_families``: the ``sluice_router_*`` Prometheus families (docs/router.md, "Live
  routing", **Metrics**), read from the client's counters at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.api.engine_client import EngineStats

if TYPE_CHECKING:
    from services.routing.client import RoutedEngineClient

# Engine stats that are per-replica means, not counters: ``merge_stats`` averages them over
# the replicas that measured one (> 0) instead of summing them.
MEAN_EXTRA_STATS = frozenset({"kv_store_fetch_s_per_block"})


def mean_measured(values: Iterable[float]) -> float | None:
    """Mean of the values > 0 (a replica reports 0.0 until it measured something); None
    when none is."""
    measured = [v for v in values if v > 0]
    return sum(measured) / len(measured) if measured else None


def merge_stats(per: Sequence[EngineStats], replicas_up: int) -> EngineStats:
    """The replicas' stats ``per`` as one engine's, with ``extra["replicas_up"]``."""
    extra: dict[str, float] = {}
    for s in per:
        for k, v in s.extra.items():
            extra[k] = extra.get(k, 0.0) + v
    for k in MEAN_EXTRA_STATS & extra.keys():
        extra[k] = mean_measured(s.extra.get(k, 0.0) for s in per) or 0.0
    extra["replicas_up"] = float(replicas_up)

    def total(name: str) -> int:
        return sum(int(getattr(s, name)) for s in per)

    return EngineStats(
        running=total("running"), waiting=total("waiting"), free_blocks=total("free_blocks"),
        total_blocks=total("total_blocks"), requests_total=total("requests_total"),
        aborted_total=total("aborted_total"), finished_total=total("finished_total"),
        steps=total("steps"), extra=extra,
    )  # fmt: skip


def router_families(client: RoutedEngineClient) -> Iterator[Metric]:
    """The router's series of ``client``: per replica (labelled ``replica``, counters also
    ``policy``), the store view, failovers and the SWA directory lookups."""
    per_replica = (
        ("sluice_router_routed_requests", "Requests routed to each replica.", client.routed),
        ("sluice_router_prompt_tokens", "Prompt tokens of finished requests, per replica.", client.prompt_tokens),
        ("sluice_router_prefix_hit_tokens", "Prompt tokens served from each replica's prefix cache.",
         client.hit_tokens),
        ("sluice_router_cache_events_lost", "Cache events a replica dropped (then resnapshotted).",
         client.events_lost),
        ("sluice_router_store_events", "KV-store block hashes a replica reported to the router.",
         client.store_events),
    )  # fmt: skip
    for name, doc, values in per_replica:
        c = CounterMetricFamily(name, doc, labels=["replica", "policy"])
        for i, v in enumerate(values):
            c.add_metric([str(i), client.policy], float(v))
        yield c
    up = GaugeMetricFamily(
        "sluice_router_replica_up", "1 while the replica can be routed to.", labels=["replica"]
    )
    blocks = GaugeMetricFamily(
        "sluice_router_index_blocks",
        "Blocks the router's prefix index holds per replica.",
        labels=["replica"],
    )
    for i, r in enumerate(client.replicas):
        up.add_metric([str(i)], float(r.alive))
        blocks.add_metric([str(i)], float(client.router.index.engine_blocks(i)))
    yield up
    yield blocks
    yield GaugeMetricFamily(
        "sluice_router_store_blocks",
        "Blocks the router's view of the KV store holds (a bounded hint, see docs/router.md).",
        value=float(client.router.index.store_blocks()),
    )
    yield GaugeMetricFamily(
        "sluice_router_store_fetch_seconds_per_block",
        "Store fetch cost the router prices store hits at (engines' measured mean; 0: unmeasured, store ignored).",
        value=float(client.router.config.store_fetch_s_per_block or 0.0),
    )
    yield CounterMetricFamily(
        "sluice_router_failovers",
        "Requests re-routed after a replica refused them.",
        value=client.failovers,
    )
    slots = (
        ("sluice_router_swa_lookups", "SWA directory lookups of prompts with a prefix hit.", client.swa_lookups),
        ("sluice_router_swa_lookup_failures", "SWA directory lookups that failed or timed out (routed without).",
         client.swa_lookup_failures),
        ("sluice_router_swa_slots_found", "Lookups that found a slot the prompt extends.", client.swa_slots_found),
    )  # fmt: skip
    for name, doc, value in slots:
        yield CounterMetricFamily(name, doc, value=value)
