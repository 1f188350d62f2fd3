"""`services.ray.serving.merge_decode_stats`: what /metrics reads for a Ray deployment, the
prefill front's stats with every decode engine's."""

from __future__ import annotations

import pytest

from services.api.engine_client import EngineStats
from services.ray.serving import merge_decode_stats


def _stats(running: int, extra: dict[str, float]) -> EngineStats:
    return EngineStats(running, 0, 10, 20, 5, 0, 2, 7, extra=extra)


def test_counts_add_speculation_keeps_its_names_and_cost_scales_average() -> None:
    front = _stats(1, {"preemptions": 1.0})
    a = _stats(
        2,
        {
            "preemptions": 3.0,
            "spec_verified_tokens": 10.0,
            "spec_cost_scale_plain": 0.9,
            "spec_cost_host_seconds": 1e-4,
        },
    )
    b = _stats(
        3,
        {
            "preemptions": 4.0,
            "spec_verified_tokens": 5.0,
            "spec_cost_scale_plain": 1.1,
            "spec_cost_host_seconds": 3e-4,
        },
    )
    got = merge_decode_stats(front, [a, b])
    assert (got.running, got.total_blocks, got.requests_total, got.steps) == (6, 60, 5, 21)
    assert got.extra["preemptions"] == 1.0 and got.extra["decode_preemptions"] == 7.0
    assert got.extra["spec_verified_tokens"] == 15.0  # a counter: summed
    assert got.extra["spec_cost_scale_plain"] == pytest.approx(1.0)  # a ratio: averaged, not 2.0
    assert "decode_spec_cost_scale_plain" not in got.extra
    assert got.extra["spec_cost_host_seconds"] == pytest.approx(2e-4)  # seconds a step: averaged
