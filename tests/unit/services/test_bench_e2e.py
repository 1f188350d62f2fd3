"""``sluice bench e2e`` end to end on a small workload: real Ray actors, a real KV store."""

from __future__ import annotations

import json
import math

import pytest

from services.bench import e2e

pytestmark = pytest.mark.integration


def test_prompts_share_the_trace_prefixes() -> None:
    a = e2e.build_prompt([0, 1, 2], 80, 32, "s", 1024)
    b = e2e.build_prompt([0, 1, 3], 70, 32, "s", 1024)
    assert len(a) == 80 and len(b) == 70
    assert a[:64] == b[:64] and a[64:70] != b[64:70]
    assert all(10 <= t < 1000 for t in a)
    assert e2e.build_prompt([0], 32, 32, "other", 1024) != a[:32]  # the salt separates runs


def test_scale_trace() -> None:
    rows = [
        {"timestamp": 1000, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 4000, "input_length": 700, "output_length": 500, "hash_ids": [0, 2]},
    ]
    reqs = e2e.scale_trace(rows, 1 / 16, 2.0, 8192, "s", 1024)
    assert [len(r.prompt) for r in reqs] == [62, 44]
    assert [r.max_tokens for r in reqs] == [2, 31]  # at least 2
    assert [r.arrival_s for r in reqs] == [0.0, 6.0]
    assert reqs[0].prompt[:32] == reqs[1].prompt[:32]


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_bench_e2e_json(ray_local, checkpoint_factory, capsys) -> None:
    from services.cli import main

    model = checkpoint_factory("tiny")
    argv = ["bench", "e2e", "--json", "--parts", "real", "--model", str(model), "--requests", "3"]
    argv += ["--probe-tokens", "512", "--time-scale", "1", "--request-timeout", "60"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "e2e" and out["config"]["parts"] == ["real"]
    assert "simulator" not in out["results"] and "handoff_131k" not in out["results"]
    assert out["config"]["scaling"]["token_scale"] == pytest.approx(1 / 16)
    res = out["results"]
    for name in ("colocated", "disaggregated", "disaggregated_grpc"):
        replay = res[name]["replay"]
        assert replay["completed"] == 3 and replay["failed"] == 0
        for key in ("ttft_s", "t2_s", "tpot_s"):
            assert replay[key]["p50"] > 0 and replay[key]["p99"] >= replay[key]["p50"]
        assert replay["throughput_tok_s"] > 0
        assert res[name]["probe"]["t2_s"]["p50"] > 0
    for name in ("disaggregated", "disaggregated_grpc"):  # the same bytes, either transport
        handoff = res[name]["handoff"]
        assert handoff["handoffs_in"] == 3 and handoff["handoff_bytes_in"] > 0
        assert handoff["formula_bytes_per_request"] > 0
        assert 0.5 < handoff["measured_over_formula"] < 2.0
    targets = {t["name"]: t for t in out["targets"]}
    for name in ("t2_ratio_low_load", "t2_ratio_low_load (grpc)"):
        t2 = targets[name]
        assert t2["op"] == "<=" and t2["target"] == 1.1 and math.isfinite(t2["value"])
