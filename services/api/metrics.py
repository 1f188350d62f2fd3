"""Prometheus metrics of one server, on its own registry (no process-global state).

Names follow Prometheus conventions (``_total`` counters, ``_seconds`` histograms).
Engine gauges (running, waiting, free blocks) are read from ``EngineClient.stats()`` at
scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from services.api.engine_client import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_api_time_to_first_token_seconds", "Time to the first generated token.", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
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
