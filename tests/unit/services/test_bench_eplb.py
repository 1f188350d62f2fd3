"""`sluice bench eplb`: the JSON contract, synthetic and recorded loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from router.eplb.loadgen import DriftingZipfLoads, LoadGenConfig
from services.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["bench", "eplb", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_quick_synthetic_run_reports_every_policy_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--quick", "--seeds", "1", "--layers", "2")
    assert out["bench"] == "eplb" and "cpu" in out["machine"]
    assert set(out["results"]) == {"prefill EP2", "prefill EP4", "prefill EP8", "decode EP64"}
    ep4 = out["results"]["prefill EP4"]["imbalance_mean_over_seeds"]
    assert set(ep4) == {
        "none",
        "static",
        "eplb:deepseek_hierarchical",
        "eplb:waterfill_swap",
        "eplb:waterfill_sticky",
        "eplb:waterfill_sticky_lazy",
    }
    assert ep4["eplb:waterfill_sticky"] < ep4["none"]
    moved = out["results"]["prefill EP4"]["moved_slot_fraction_per_replacement"]
    assert 0 < moved["waterfill_sticky"] < moved["deepseek_hierarchical"]  # keeps experts in place
    gen = out["config"]["cases"]["decode EP64"]["generator"]
    assert gen["num_experts"] == 256 and gen["top_k"] == 6 and gen["tokens_per_step"] == 256 * 64
    names = {t["name"]: t for t in out["targets"]}
    t = names["prefill EP2 imbalance eplb:waterfill_sticky"]
    assert (
        t["op"] == "<="
        and t["target"] == 1.045
        and t["value"]
        == pytest.approx(out["results"]["prefill EP2"]["imbalance_mean_over_seeds"]["eplb:waterfill_sticky"])
    )
    assert "decode EP64 imbalance eplb:waterfill_sticky / eplb:deepseek_global" in names
    assert all(isinstance(t["met"], bool) for t in out["targets"])


def test_recorded_loads_go_through_the_same_pipeline(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = DriftingZipfLoads(
        LoadGenConfig(num_experts=16, num_layers=2, tokens_per_step=512, drift_period_steps=2000)
    )
    path = tmp_path / "loads.npz"
    np.savez(path, counts=gen.counts(np.arange(400)))
    out = _run(capsys, "--loads", str(path), "--window", "20", "--period", "100", "--ep", "2", "4")
    assert set(out["results"]) == {"recorded prefill EP2", "recorded prefill EP4"}
    assert out["config"]["loads"]["shape"] == [400, 2, 16]
    res = out["results"]["recorded prefill EP4"]
    assert res["eval_steps_per_run"] == 380 and res["placements_per_run"] == 4
    imb = res["imbalance_mean_over_seeds"]
    assert imb["eplb:waterfill_sticky"] < imb["none"]


def test_recorded_loads_too_short_is_an_actionable_error(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "short.npz"
    np.savez(path, counts=np.ones((50, 1, 8), dtype=np.int64))
    assert main(["bench", "eplb", "--loads", str(path)]) == 2
    assert "need more than window + period" in capsys.readouterr().err
