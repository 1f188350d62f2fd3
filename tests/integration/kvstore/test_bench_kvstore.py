"""`sluice bench kvstore --only store` end to end on a small load: 12 real node processes, a
real Redis, nodes killed and restarted between the healthy and degraded rounds."""

from __future__ import annotations

import json

import pytest

from services.cli import main


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_store_bench_reports_every_size_target_and_degraded_cycle(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "kvstore", "--json", "--only", "store", "--sizes", "65536,262144",
            "--bytes-per-size", "1048576", "--rounds", "1", "--cycles", "2", "--latency-samples", "10",
            "--latency-size", "65536"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    res = out["results"]
    assert set(res["store"]) == set(res["degraded"]) == {"65536", "262144"}
    small = res["store"]["65536"]
    assert small["count"] == 16 and small["store"]["objects"] == 1  # 16 blocks of 64 KiB: one group
    for size, row in res["store"].items():
        assert row["store"]["get_GBps"] > 0 and row["redis"]["get_GBps"] > 0, size
        assert res["degraded"][size]["ratio"] == pytest.approx(
            res["degraded"][size]["get_GBps"] / row["store"]["get_GBps"]
        )
    assert res["hedge_factor"] == 5.0 and res["latency"]["samples"] == 10
    names = {t["name"] for t in out["targets"]}
    assert "store_get_GBps / redis_get_GBps (256 KiB)" in names
    assert "degraded_get_GBps / healthy_get_GBps (64 KiB)" in names
    assert "get_p99_ms / get_p50_ms" in names
