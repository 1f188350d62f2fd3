"""``sluice bench e2e``'s ``simulator`` and ``handoff_131k`` sections: the step model and the
report shape (small runs: a few dozen simulated requests, a short prompt handed off)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from services.bench import _e2e_sim, e2e


def test_step_model_extends_the_gpu_decode_tables_to_full_depth() -> None:
    """Decode: each cell of the 2- and 4-layer H200 tables extended by the measured cost of a
    layer, then fitted; prefill: the 2-layer prefill step minus the decode table's fixed
    cost, per token, scaled by 43 / 2."""
    from router.steptable import StepTable

    step, info = _e2e_sim.step_model()
    m = info["measured_layers"]
    assert info["depth_scale"] == _e2e_sim.FULL_LAYERS / 2 == 21.5
    assert step.d == pytest.approx(m["d_s_per_token"] * 21.5)
    t2, t4 = (StepTable.load(_e2e_sim.DECODE_TABLES[n]) for n in (2, 4))
    assert t2.meta["device"] == "cuda" and t2.meta["decode_graphs"] and t4.meta["layers"] == 4
    for i, b in enumerate(t2.batch):
        for j, k in enumerate(t2.kv_tokens):
            if k / b > _e2e_sim.DECODE_FIT_MAX_TOKENS_PER_SEQUENCE:
                continue
            full = t4.seconds[i, j] + 39 * (t4.seconds[i, j] - t2.seconds[i, j]) / 2
            assert step.decode_step(int(b), k) == pytest.approx(full, rel=0.3)  # a linear fit's residual
            assert full > t4.seconds[i, j] > t2.seconds[i, j]  # every layer costs time
    pf = _e2e_sim.MEASURED["prefill_step"]
    two = m["c_s"] + 2 * (
        m["d_s_per_token"] * 2048 + m["a_s_per_pair"] * 2048**2 + m["d2_s_per_kv_token"] * 2048
    )
    assert two == pytest.approx(pf["seconds"])
    assert info["cache_bytes_per_token_bf16"] > 0 and info["window_slot_bytes_bf16"] > 0


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_parts() -> None:
    assert e2e.parts_of(_args()) == ("real", "sim")  # the long handoff is asked for
    assert e2e.parts_of(_args(sim_only=True)) == ("sim",)
    assert e2e.parts_of(_args(handoff_only=True)) == ("handoff",)
    assert e2e.parts_of(_args(parts="handoff,sim")) == ("sim", "handoff")
    with pytest.raises(ValueError, match="--parts"):
        e2e.parts_of(_args(parts="sim,nope"))
    with pytest.raises(ValueError, match="exclude"):
        e2e.parts_of(_args(sim_only=True, handoff_only=True))


def test_sim_only_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    argv = ["bench", "e2e", "--json", "--sim-only", "--sim-requests", "40"]
    argv += ["--sim-traces", "synthetic_trace", "--sim-budgets", "512,32768"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "e2e" and out["config"]["parts"] == ["sim"]
    sim = out["results"]["simulator"]
    assert sim["model"]["full_layers"] == 43 and "goodput_definition" in sim
    tr = sim["traces"]["synthetic_trace"]
    assert tr["requests"] == 40 and 0 < tr["feasible_share"] <= 1
    assert len(tr["disaggregated"]["points"]) == len(_e2e_sim.LOAD_GRID)
    by = tr["colocated"]["by_policy_and_budget"]
    assert set(by) == {"sluice", "least_load"} and all(set(v) == {"512", "32768"} for v in by.values())
    head = tr["headline"]
    assert head["colocated_best_budget"] in (512, 32768) and head["colocated_best_prefill_policy"] in by
    assert head["level"] is None or head["level"] in _e2e_sim.LEVELS
    for p in tr["disaggregated"]["points"]:
        assert (
            0 <= p["attainment"] <= p["attainment_feasible"] <= 1
        )  # every request meeting the SLOs is feasible
        assert p["slo_met_req_s"] == pytest.approx(p["rate_req_s"] * p["attainment"])
    (target,) = out["targets"]
    assert target["name"] == "simulator goodput, disaggregated / colocated (synthetic_trace)"
    assert target["op"] == ">=" and target["target"] == 1.5


def test_sim_is_deterministic() -> None:
    args = _args(sim_requests=30, sim_traces="conversation_trace", sim_budgets="4096")
    a, b = _e2e_sim.run_simulator(args), _e2e_sim.run_simulator(args)
    pa = a["traces"]["conversation_trace"]
    pb = b["traces"]["conversation_trace"]
    assert pa["disaggregated"]["points"] == pb["disaggregated"]["points"]
    assert pa["colocated"]["by_policy_and_budget"] == pb["colocated"]["by_policy_and_budget"]


def test_handoff_only_report_shape(tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    argv = ["bench", "e2e", "--json", "--handoff-only", "--handoff-tokens", "600", "--handoff-chunk", "256"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    h = out["results"]["handoff_131k"]
    assert h["prompt_tokens"] == 600 and h["prefill_steps"] == 3  # 256 + 256 + 88
    assert h["first_tokens_on_prefill_engine"] == 1 and h["decoded_after_import"] == 1
    assert h["overlaps_compute_layer_by_layer"] is False and h["overlap"].startswith("no:")
    b = h["bytes"]
    assert b["measured_bytes_per_request"] == h["payload_bytes"] > 0
    # the payload is the cache formula plus block headers and the JSON metadata
    assert 1.0 < b["measured_over_formula"] < 1.3
    assert math.isfinite(h["export_ms"]) and math.isfinite(h["import_ms"])
    assert "tiny-ctx" in h["model"]
