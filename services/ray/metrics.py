"""Metrics of the Ray pools, per pool and engine, as the API process sees them.

Two kinds:

* **Latencies the client sees**, measured in the API process where the outputs arrive
  (``PoolMetrics``, observed by ``RayEngineReplica``): time to the first token per prefill
  (or colocated) engine, time per output token per engine that streams the rest, and the
  handoff gap per decode engine: from the prefill engine's last output (the sequence is
  exported) to the decode engine's first (imported, and one step run). The bench's "t2".
* **Engine state**, read from the state each engine pushes (no engine call at scrape
  time): queue depth, running requests, KV tokens, handoff bytes received, and for EP
  instances the EPLB load imbalance of the last window (max/mean over ranks, mean over
  layers, under the placement that served it) and the imbalance the new placement plans.

Every series carries ``pool`` (``prefill``, ``decode`` or ``colocated``) and ``engine``
(the replica's name, e.g. ``decode-1.0``: instance 1, rank 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.api.metrics import LATENCY_BUCKETS  # the API's, so the two histograms compare

if TYPE_CHECKING:
    from services.api.engine_client import EngineOutput

log = logging.getLogger("services.ray.replica")  # the request lines, beside the replica's

_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)

# (metric name, help, stats key, counter?) read from each engine's pushed stats
_ENGINE_SERIES = (
    ("sluice_pool_queued_requests", "Requests waiting inside the engine (queue depth).", "waiting", False),
    ("sluice_pool_running_requests", "Requests the engine is generating for.", "running", False),
    ("sluice_pool_kv_tokens", "KV tokens the engine's running sequences hold.", "kv_tokens", False),
    (
        "sluice_pool_waiting_kv_tokens",
        "KV tokens the engine's waiting sequences will hold once admitted (owed, counted as load).",
        "waiting_tokens",
        False,
    ),
    ("sluice_pool_handoff_bytes", "Handoff payload bytes the engine imported.", "handoff_bytes_in", True),
    ("sluice_pool_handoffs", "Sequences the engine imported.", "handoffs_in", True),
    ("sluice_pool_handoffs_out", "Sequences the engine exported.", "handoffs_out", True),
    (
        "sluice_eplb_imbalance",
        "EPLB: max/mean expert load over the instance's ranks in the last window, under the "
        "placement that served it (mean over layers; 1 is perfect).",
        "eplb_imbalance",
        False,
    ),
    (
        "sluice_eplb_planned_imbalance",
        "EPLB: the same window's imbalance under the placement chosen from it.",
        "eplb_imbalance_planned",
        False,
    ),
    ("sluice_eplb_layers_moved", "EPLB: MoE layers whose experts were re-placed.", "eplb_layers_moved", True),
)


class PoolMetrics:
    """The latency histograms, on a private registry (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["pool", "engine"]
        self.ttft = Histogram(
            "sluice_pool_time_to_first_token_seconds",
            "From the request reaching the engine's replica to its first token, per engine.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "sluice_pool_time_per_output_token_seconds",
            "Gap between outputs divided by the tokens of the later one, per engine streaming them.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.handoff = Histogram(
            "sluice_handoff_seconds",
            "From the prefill engine's last output (sequence exported) to the decode engine's "
            "first (imported and stepped once), per decode engine.",
            ["engine"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def first_token(self, pool: str, engine: str, seconds: float) -> None:
        self.ttft.labels(pool=pool, engine=engine).observe(seconds)

    def next_tokens(self, pool: str, engine: str, seconds: float, tokens: int) -> None:
        if tokens > 0:
            per = seconds / tokens
            child = self.tpot.labels(pool=pool, engine=engine)
            for _ in range(tokens):
                child.observe(per)

    def handed_off(self, engine: str, seconds: float) -> None:
        self.handoff.labels(engine=engine).observe(seconds)

    def families(self, engines: Iterable[tuple[str, Any]]) -> Iterator[Metric]:
        """The histograms, then the engine series for ``engines``: ``(pool, replica)`` pairs
        whose ``name`` and ``stats()`` (pushed state) are read."""
        yield from self.registry.collect()
        made: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for pool, replica in engines:
            s = replica.stats()
            values = {"waiting": s.waiting, "running": s.running, **s.extra}
            for name, doc, key, counter in _ENGINE_SERIES:
                if key not in values:
                    continue
                if name not in made:
                    made[name] = (CounterMetricFamily if counter else GaugeMetricFamily)(
                        name, doc, labels=["pool", "engine"]
                    )
                made[name].add_metric([pool, replica.name], float(values[key]))
        yield from made.values()


class RequestClock:
    """A request's latencies as its outputs reach this process (see ``services.ray.metrics``):
    the first token is charged to the engine that produced it, later tokens to the engine
    streaming them, and the gap after a handoff to the decode engine it went to."""

    def __init__(self, metrics: PoolMetrics | None, request_id: str, pool: str, engine: str) -> None:
        self.metrics, self.request_id, self.pool, self.engine = metrics, request_id, pool, engine
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.count = 0
        self._handoff_to: str | None = None

    def hand_to(self, engine: str) -> None:
        """The rest streams from decode ``engine``; the next output closes the handoff gap."""
        self._handoff_to, self.pool, self.engine = engine, "decode", engine

    def tokens(self, out: EngineOutput) -> None:
        n = len(out.token_ids)
        if n == 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if m is not None:
            if self.first is None:
                m.first_token(self.pool, self.engine, now - self.start)
            elif self._handoff_to is not None:
                m.handed_off(self._handoff_to, now - self.last)
            else:
                m.next_tokens(self.pool, self.engine, now - self.last, n)
        if self.first is None:
            self.first = now
        self._handoff_to = None
        self.last, self.count = now, self.count + n

    def done(self) -> None:
        if self.first is not None:
            log.info(
                "request %s: %d tokens, first after %.3f s, last engine %s",
                self.request_id, self.count, self.first - self.start, self.engine,
            )  # fmt: skip
