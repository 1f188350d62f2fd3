"""``/metrics`` carries DSpark's measured step-cost scales (``EngineStats.extra["spec_cost_scale_*"]``)
and its counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.api.engine_client import EngineStats
from services.api.metrics import ApiMetrics


def _scales(extra: dict[str, float]) -> dict[str, tuple[str, float]]:
    metrics = ApiMetrics(lambda: EngineStats(0, 0, 10, 10, 0, 0, 0, 3, extra=extra))
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "sluice_spec_cost_scale":
                out[sample.labels["kind"]] = (family.type, sample.value)
    return out


def test_measured_cost_scales_are_gauges_per_kind_of_step() -> None:
    got = _scales({"spec_steps": 4.0, "spec_cost_scale_plain": 0.93, "spec_cost_scale_speculating": 1.01})
    assert got == {"plain": ("gauge", 0.93), "speculating": ("gauge", 1.01)}


def test_an_engine_that_takes_its_profile_as_it_is_exports_no_scale() -> None:
    assert _scales({"spec_steps": 4.0, "spec_verified_tokens": 12.0}) == {}


def test_speculation_counters_include_probes_and_cold_steps() -> None:
    metrics = ApiMetrics(
        lambda: EngineStats(
            0, 0, 10, 10, 0, 0, 0, 3, extra={"spec_steps": 9.0, "spec_probes": 3.0, "spec_cold_steps": 3.0}
        )
    )
    got = {
        s.name: (f.type, s.value)
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name.startswith(("sluice_spec_probes", "sluice_spec_cold_steps"))
    }
    assert got == {
        "sluice_spec_probes_total": ("counter", 3.0),
        "sluice_spec_cold_steps_total": ("counter", 3.0),
    }


def test_dsparks_choice_host_time_is_a_gauge_beside_the_scales() -> None:
    metrics = ApiMetrics(
        lambda: EngineStats(
            0, 0, 10, 10, 0, 0, 0, 3,
            extra={"spec_steps": 4.0, "spec_cost_scale_plain": 1.0, "spec_cost_host_seconds": 2.5e-4},
        )
    )  # fmt: skip
    got = {
        s.name: (f.type, s.value)
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name == "sluice_spec_choice_host_seconds"
    }
    assert got == {"sluice_spec_choice_host_seconds": ("gauge", 2.5e-4)}
