"""Prometheus metrics of one server, on its own registry (no process-global state).

Names follow Prometheus conventions (``_total`` counters, ``_seconds`` histograms).
Engine gauges (running, waiting, free blocks) are read from ``EngineClient.stats()`` at
scrape time, so they are never stale. So are the engine's KV-store connector counters
(``EngineStats.extra["kv_store_*"]``, present when the engine has a store): each becomes
``sluice_kv_store_<name>_total`` (a counter) or, for the levels, a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.api.engine_client import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

_KV_STORE = "kv_store_"
# The connector's counters (engine.kvconnector.connector.ConnectorStats): only ever rise.
_KV_STORE_COUNTERS = {
    "fetches": "Prefix fetches asked of the KV store.",
    "fetched_blocks": "Blocks loaded from the KV store (verified).",
    "fetch_failures": "KV store fetches that failed or missed their deadline; the prefix was recomputed.",
    "corrupt_blocks": "KV store blocks refused by verification; recomputed from there.",
    "saved_blocks": "Blocks written to the KV store.",
    "save_failures": "Blocks whose KV store write failed.",
    "dropped_blocks": "Blocks not written to the KV store: the write-through queue was full.",
    "deduplicated_blocks": "Blocks not written to the KV store: known to be there already.",
}
# Levels, and their Prometheus names where the engine's key carries no unit word.
_KV_STORE_GAUGES = {
    "queued_bytes": ("sluice_kv_store_queued_bytes", "Bytes waiting in the write-through queue."),
    "fetch_s_per_block": (
        "sluice_kv_store_fetch_seconds_per_block",
        "Mean seconds per block of answered KV store fetches.",
    ),
}


def _kv_store_families(extra: dict[str, float]) -> Iterator[Metric]:
    """The ``kv_store_*`` entries of ``EngineStats.extra``; unknown ones as gauges."""
    for key, value in sorted(extra.items()):
        if not key.startswith(_KV_STORE):
            continue
        name = key[len(_KV_STORE) :]
        family: Metric
        if name in _KV_STORE_COUNTERS:
            family = CounterMetricFamily(f"sluice_kv_store_{name}", _KV_STORE_COUNTERS[name])
        else:
            metric, doc = _KV_STORE_GAUGES.get(name, (f"sluice_kv_store_{name}", f"Engine KV store {name}."))
            family = GaugeMetricFamily(metric, doc)
        family.add_metric([], float(value))
        yield family


def _vision_families(extra: dict[str, float]) -> Iterator[Metric]:
    """The vision stage (engine/vision/stage.py): images encoded, encoder-cache hits, time
    spent encoding, images waiting for the encoder, and the cache's bytes."""
    for name, key, doc, kind in (
        (
            "sluice_vision_images_encoded",
            "vision_images_encoded",
            "Images run through the vision encoder.",
            "c",
        ),
        (
            "sluice_vision_cache_hits",
            "vision_cache_hits",
            "Images whose rows came from the encoder cache.",
            "c",
        ),
        ("sluice_vision_encode_seconds", "vision_encode_s", "Seconds spent in the vision encoder.", "c"),
        ("sluice_vision_queue", "vision_queue", "Images waiting for or in the vision encoder.", "g"),
        ("sluice_vision_cache_bytes", "vision_cache_bytes", "Bytes of rows in the encoder cache.", "g"),
    ):
        if kind == "c":
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], extra.get(key, 0.0))
            yield counter
        else:
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], extra.get(key, 0.0))
            yield gauge


def _spec_families(extra: dict[str, float]) -> Iterator[Metric]:
    """Speculative decoding (engine/spec/): steps that had drafts, drafts proposed, verified
    and accepted (per step: divide by the steps), the host time of the policy's choice, the
    policy each such step chose, the drafting depth it set, and how far the engine's own
    step times are from its profile's (`engine.spec.costs.StepCosts`)."""
    for name, key, doc in (
        ("sluice_spec_steps", "spec_steps", "Decode steps the speculation policy planned."),
        ("sluice_spec_probes", "spec_probes", "Steps that drafted while speculation was off (probes)."),
        (
            "sluice_spec_cold_steps",
            "spec_cold_steps",
            "Steps that verified drafts made from restarted MTP windows (after a step without drafting).",
        ),
        ("sluice_spec_drafted_tokens", "spec_drafted_tokens", "Draft tokens the MTP layer proposed."),
        ("sluice_spec_verified_tokens", "spec_verified_tokens", "Draft tokens put into verification."),
        ("sluice_spec_accepted_tokens", "spec_accepted_tokens", "Verified drafts the target accepted."),
        (
            "sluice_spec_choose_seconds",
            "spec_choose_seconds",
            "Host seconds the policy spent choosing drafts.",
        ),
    ):
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], extra.get(key, 0.0))
        yield counter
    chosen = CounterMetricFamily(
        "sluice_spec_policy_steps", "Steps by the speculation policy chosen.", labels=["policy"]
    )
    for label, value in _suffixed(extra, "spec_policy_"):
        chosen.add_metric([label.replace("_", "-")], value)
    yield chosen
    depth = CounterMetricFamily(
        "sluice_spec_depth_steps",
        "Steps by the drafting depth the policy set for the next step (0: no drafting).",
        labels=["depth"],
    )
    for label, value in _suffixed(extra, "spec_depth_"):
        depth.add_metric([label], value)
    yield depth
    scales = list(_suffixed(extra, "spec_cost_scale_"))
    if scales:  # DSpark on a profile that prices drafting, measured costs on
        scale = GaugeMetricFamily(
            "sluice_spec_cost_scale",
            "DSpark's measured over profiled step time, per kind of step (1: the profile holds; "
            "the mean over decode engines).",
            labels=["kind"],
        )
        for label, value in scales:
            scale.add_metric([label], value)
        yield scale
        host = GaugeMetricFamily(
            "sluice_spec_choice_host_seconds",
            "DSpark's host seconds choosing a step's drafts (median of recent steps with drafts; "
            "priced into speculating options; the mean over decode engines).",
        )
        host.add_metric([], extra.get("spec_cost_host_seconds", 0.0))
        yield host


def _suffixed(extra: dict[str, float], prefix: str) -> Iterator[tuple[str, float]]:
    """(what follows ``prefix``, value) of each ``extra`` key that starts with it, sorted."""
    for key, value in sorted(extra.items()):
        if key.startswith(prefix):
            yield key.removeprefix(prefix), value


def _swa_families(extra: dict[str, float]) -> Iterator[Metric]:
    """Sliding-window state of prefix hits (engine ``stats().extra``): slots adopted, replays
    by kind and the tokens they recomputed, and the slot pool's occupancy."""
    hits = CounterMetricFamily(
        "sluice_swa_slot_hits", "Prefix hits whose window state was an existing slot.", labels=["where"]
    )
    hits.add_metric(["local"], extra.get("swa_slot_hits_local", 0.0))
    hits.add_metric(["host"], extra.get("swa_slot_hits_host", 0.0))
    replays = CounterMetricFamily(
        "sluice_swa_replays", "Prefix hits whose window state was rebuilt by replay.", labels=["kind"]
    )
    tokens = CounterMetricFamily(
        "sluice_swa_replayed_tokens", "Tokens recomputed to rebuild window states.", labels=["kind"]
    )
    for kind in ("exact", "bounded"):
        replays.add_metric([kind], extra.get(f"swa_replays_{kind}", 0.0))
        tokens.add_metric([kind], extra.get(f"swa_replayed_tokens_{kind}", 0.0))
    slots = GaugeMetricFamily("sluice_swa_slots", "Sliding-window slots of the engine(s).", labels=["state"])
    total, free = extra.get("total_swa_slots", 0.0), extra.get("free_swa_slots", 0.0)
    retained = extra.get("retained_swa_slots", 0.0)
    for state, value in (("held", total - free), ("retained", retained), ("free", free - retained)):
        slots.add_metric([state], value)
    yield from (hits, replays, tokens, slots)
    if "swa_slot_fetches" in extra:  # slots shared with other engines (an SWA directory)
        fetches = CounterMetricFamily(
            "sluice_swa_slot_fetches", "Slots fetched from other engines, by result.", labels=["result"]
        )
        fetches.add_metric(["ok"], extra["swa_slot_fetched"])
        fetches.add_metric(["failed"], extra["swa_slot_fetch_failures"])
        yield fetches
        for key, name, doc in (
            (
                "swa_slot_fetched_bytes",
                "sluice_swa_slot_fetched_bytes",
                "Bytes of slots fetched from other engines.",
            ),
            ("swa_slots_served", "sluice_swa_slots_served", "Slots sent to other engines."),
            (
                "swa_slot_served_bytes",
                "sluice_swa_slot_served_bytes",
                "Bytes of slots sent to other engines.",
            ),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], extra[key])
            yield c
    if "host_swa_budget_bytes" in extra:  # the host slot pool, when the engine has one
        for key, name, doc in (
            ("host_swa_slots", "sluice_swa_host_slots", "Slots in the host slot pool."),
            ("host_swa_bytes", "sluice_swa_host_bytes", "Bytes the host slot pool holds."),
            ("host_swa_budget_bytes", "sluice_swa_host_budget_bytes", "The host slot pool's byte budget."),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], extra[key])
            yield g
        for key, name, doc in (
            ("host_swa_saved", "sluice_swa_host_saved_slots", "Slots saved to the host pool (turns ended)."),
            ("host_swa_evicted", "sluice_swa_host_evicted_slots", "Slots the host pool evicted (LRU)."),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], extra[key])
            yield c


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):  # -> Iterator[GaugeMetricFamily]
        try:
            s = self._stats()
        except Exception:  # a scrape must not fail because the engine is down
            return
        for name, value, doc in (
            ("sluice_engine_running", s.running, "Requests the engine is generating for."),
            ("sluice_engine_waiting", s.waiting, "Requests queued inside the engine."),
            ("sluice_engine_free_blocks", s.free_blocks, "Free KV-cache blocks."),
            ("sluice_engine_total_blocks", s.total_blocks, "KV-cache blocks in the pool."),
            ("sluice_engine_steps", s.steps, "Engine steps run."),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield from _kv_store_families(s.extra)
        if "total_swa_slots" in s.extra:
            yield from _swa_families(s.extra)
        if "vision_images_encoded" in s.extra:
            yield from _vision_families(s.extra)
        if "spec_steps" in s.extra:
            yield from _spec_families(s.extra)


@runtime_checkable
class MetricsSource(Protocol):
    """An engine client with metrics of its own (e.g. the router's per-replica counters).

    ``metric_families`` is called at scrape time on the event loop's worker thread; it only
    reads counters (no I/O, no engine round trip) and must not raise.
    """

    def metric_families(self) -> Iterable[Metric]: ...


class _SourceCollector:
    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        yield from self._source.metric_families()


class ApiMetrics:
    def __init__(
        self, engine_stats: Callable[[], EngineStats] | None = None, sources: Sequence[MetricsSource] = ()
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sluice_api_requests",
            "Requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "sluice_api_rejections",
            "Requests refused, by reason (the limit or check).",
            ["reason"],
            registry=r,
        )
        self.latency = Histogram(
            "sluice_api_request_seconds",
            "End-to-end request latency.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_api_time_to_first_token_seconds", "Time to the first generated token.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "sluice_api_prompt_tokens", "Prompt tokens of served requests.", registry=r
        )
        self.cached_tokens = Counter(
            "sluice_api_cached_prompt_tokens", "Prompt tokens served from cache.", registry=r
        )
        self.completion_tokens = Counter("sluice_api_completion_tokens", "Generated tokens.", registry=r)
        self.disconnects = Counter(
            "sluice_api_client_disconnects", "Requests aborted by client disconnect.", registry=r
        )
        self.in_flight = Gauge("sluice_api_in_flight", "Requests holding an admission slot.", registry=r)
        self.queued = Gauge("sluice_api_queued", "Requests waiting for an admission slot.", registry=r)
        if engine_stats is not None:
            r.register(_EngineCollector(engine_stats))
        for source in sources:
            r.register(_SourceCollector(source))

    def reject(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
