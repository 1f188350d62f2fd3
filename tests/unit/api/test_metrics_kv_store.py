"""``/metrics`` carries the engine's KV store counters (``EngineStats.extra["kv_store_*"]``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.api.engine_client import EngineStats
from services.api.metrics import ApiMetrics


def _scrape(extra: dict[str, float]) -> dict[str, tuple[str, float]]:
    metrics = ApiMetrics(lambda: EngineStats(0, 0, 10, 10, 0, 0, 0, 3, extra=extra))
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("sluice_kv_store"):
                out[sample.name] = (family.type, sample.value)
    return out


def test_kv_store_counters_and_levels_are_exported() -> None:
    got = _scrape(
        {
            "kv_store_fetch_failures": 2.0,
            "kv_store_saved_blocks": 15.0,
            "kv_store_corrupt_blocks": 1.0,
            "kv_store_queued_bytes": 4096.0,
            "kv_store_fetch_s_per_block": 0.004,
            "preemptions": 7.0,  # not a store counter: not exported here
        }
    )
    assert got == {
        "sluice_kv_store_fetch_failures_total": ("counter", 2.0),
        "sluice_kv_store_saved_blocks_total": ("counter", 15.0),
        "sluice_kv_store_corrupt_blocks_total": ("counter", 1.0),
        "sluice_kv_store_queued_bytes": ("gauge", 4096.0),
        "sluice_kv_store_fetch_seconds_per_block": ("gauge", 0.004),
    }


def test_an_engine_without_a_store_exports_none() -> None:
    assert _scrape({"preemptions": 0.0}) == {}
