"""``sluice bench engine --preset``: the decode report on a weightless tiny model, with the
roofline's bytes from the config, the per-layer fit and transformers beside it."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import engine
from services.bench._engine_decode import kv_bytes, reference_check


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    engine.add_arguments(p)
    return p.parse_args(list(argv))


def test_kv_bytes_follow_the_layer_types() -> None:
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig

    mc = ModelConfig.from_dict(preset_config("small"))
    one = kv_bytes(mc, 4096, 1, 2)
    assert kv_bytes(mc, 4096, 8, 2) == 8 * one and kv_bytes(mc, 4096, 1, 4) == 2 * one
    window = mc.num_hidden_layers * mc.sliding_window * mc.head_dim * 2
    assert one > window  # compressed entries and indexer keys on top of every layer's window
    assert kv_bytes(mc, 64, 1, 2) < one  # a shorter context reads less


@pytest.mark.slow  # a bench smoke run (~20 s): `make test-slow`
def test_tiny_decode_report_has_the_roofline_per_layer_fit_and_transformers() -> None:
    report = engine.run(
        _args("--preset", "tiny", "--layers", "1,2", "--decode-batches", "1,16", "--context", "40",
              "--tf-context", "24", "--steps", "3", "--decode-rounds", "3")
    )  # fmt: skip
    out = json.loads(json.dumps(report.to_json()))
    dec = out["results"]["decode"]
    assert dec["copy_bandwidth_Bps"] > 0 and dec["roofline_bandwidth_Bps"] == dec["copy_bandwidth_Bps"]
    assert {(r["layers"], r["batch"]) for r in dec["engine"]} == {(1, 1), (1, 16), (2, 1), (2, 16)}
    for r in dec["engine"]:
        b = r["bytes"]
        assert r["emitted"] == r["batch"] * 3 and r["ms_per_step"] > 0
        assert b["total"] == pytest.approx(b["layer_weights"] + b["experts_selected"] + b["fixed"] + b["kv"])
        assert b["experts_selected"] > 0 and r["fraction_of_roofline"] > 0
    deeper = {r["batch"]: r["bytes"]["layer_weights"] for r in dec["engine"] if r["layers"] == 2}
    shallow = {r["batch"]: r["bytes"]["layer_weights"] for r in dec["engine"] if r["layers"] == 1}
    assert all(deeper[b] > shallow[b] for b in deeper)
    assert set(dec["per_layer_fit"]) == {"1", "16"}
    assert {r["context"] for r in dec["engine_at_tf_context"]} == {24}
    assert [t["batch"] for t in dec["transformers"]] == [1, 16] and all(
        "ms_per_step" in t for t in dec["transformers"]
    )
    for v in dec["versus_transformers"]:  # three rounds, the ratio their median
        assert [p["round"] for p in v["rounds"]] == [0, 1, 2] and {p["batch"] for p in v["rounds"]} == {
            v["batch"]
        }
        ratios = sorted(p["transformers_ms"] / p["sluice_ms"] for p in v["rounds"])
        assert v["speedup"] == pytest.approx(ratios[1])
    (target,) = out["targets"]  # on CPU: batch 16 against transformers
    assert (
        target["name"].startswith("decode at batch 16, context 24: sluice / transformers")
        and target["op"] == ">="
    )


def test_the_roofline_counts_fp8_weights_as_stored() -> None:
    """``--quant fp8``: the bytes a decode step reads are the FP8 tensors and their scales,
    not the emptied bf16/fp32 parameters (a roofline of nothing would flatter the step)."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.runner import ModelRunner, RunnerConfig
    from services.bench._engine_decode import _param_bytes

    mc = ModelConfig.from_dict(preset_config("tiny", num_hidden_layers=2))
    cfg = RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False)
    full = _param_bytes(ModelRunner.random(mc, cfg, seed=3).model, 1)
    fp8 = _param_bytes(ModelRunner.random(mc, cfg, seed=3, fp8=True).model, 1)
    assert fp8[1] == full[1]  # the head and embeddings stay as they were
    assert 0.25 < fp8[0] / full[0] < 0.75  # fp32 -> one byte + scales, some linears kept
    for (_, q), (_, f) in zip(fp8[2], full[2]):
        assert 0.25 <= q / f < 0.26  # an expert: a quarter of fp32, plus its block scales


def test_transformers_reference_check_says_why_it_is_off() -> None:
    row = {"ms_per_step": 19.1, "device_busy_ms": 4.2, "kernels_per_step": 1800}
    near = reference_check({"ms_per_step": 16.0}, 15.4, None)
    assert near["within_15_percent"] and "why" not in near
    host = reference_check(row, 15.4, 6.5)
    assert not host["within_15_percent"] and host["ratio"] == pytest.approx(19.1 / 15.4)
    assert host["why"].startswith("host-bound") and "1800 kernels" in host["why"] and "6.5 us" in host["why"]
    device = reference_check(row | {"device_busy_ms": 17.0}, 15.4, 6.5)
    assert device["why"].startswith("device-bound")
    assert "why" not in reference_check({"ms_per_step": 30.0}, 15.4, None)  # no profile: only the ratio
