"""``sluice bench engine --preset P --parts prefill``: the FLOPs the roofline counts come from the
config, and the report's parts (engine, transformers, the long prompt) are all there."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from services.bench import engine
from services.bench._engine_prefill import prefill_flops


def test_prefill_flops_are_counted_from_the_config() -> None:
    mc = ModelConfig.from_dict(preset_config("flash-shape", num_hidden_layers=2))
    per_token = prefill_flops(mc, 4096) / 4096
    assert 1.2e9 < per_token < 1.35e9  # ~1.3 GFLOP per token for two flash-shape layers
    head = 2 * mc.hidden_size * mc.vocab_size  # the lm_head, once per sequence
    one = prefill_flops(mc, 1)
    assert prefill_flops(mc, 2) - one < one  # the head is not counted per token
    assert prefill_flops(mc, 2) - head == pytest.approx(2 * (one - head), rel=0.01)
    longer = prefill_flops(mc, 16384) / 16384
    assert longer > per_token  # more compressed entries and indexer scores per query
    deeper = ModelConfig.from_dict(preset_config("flash-shape", num_hidden_layers=4))
    assert prefill_flops(deeper, 4096) > 1.9 * prefill_flops(mc, 4096) - head


@pytest.mark.slow  # a bench smoke run (~10 s): `make test-slow`
def test_tiny_prefill_report_has_the_roofline_transformers_and_the_long_prompt() -> None:
    p = argparse.ArgumentParser()
    engine.add_arguments(p)
    args = p.parse_args(
        ["--preset", "tiny", "--parts", "prefill", "--prefill-tokens", "64,128", "--long-context", "600",
         "--long-chunk", "256", "--prefill-repeats", "1", "--host-profile", "--experts-gemm", "tuned",
         "--pooling-kernel", "off"]
    )  # fmt: skip
    from engine.kernels import pooling

    setting = pooling.FUSED_POOLING
    try:
        report = json.loads(json.dumps(engine.run(args).to_json()))
    finally:
        from engine.model.experts import force_experts_gemm

        force_experts_gemm("auto")
        pooling.FUSED_POOLING = setting
    assert report["config"]["experts_gemm"] == "tuned" and report["config"]["pooling_kernel"] is False
    out = report["results"]["prefill"]
    assert [r["tokens"] for r in out["engine"]] == [64, 128]
    assert all(r["host_profile"]["functions"] for r in out["engine"])
    assert all(r["fraction_of_roofline"] > 0 and r["flops"] > 0 for r in out["engine"])
    assert all(0 < r["host_ms"] <= max(r["step_ms"]) for r in out["engine"])  # on the CPU: the step
    assert out["transformers"]["tokens"] == 64 and out["versus_transformers"]["speedup"] > 0
    long = out["long_context"]
    assert [m["tokens"] for m in long["marks"]] == [600] and len(long["chunk_ms"]) == 3  # 256 + 256 + 88
    assert all(t > 0 for t in long["chunk_ms"]) and long["first_pass_s"] > 0
    assert sum(long["chunk_ms"]) <= long["prefill_s"] * 1e3
    assert out["long_context"]["decode_steps"] == 32


def test_the_prefill_profile_times_every_cell_and_fits_the_cost_model(tmp_path) -> None:
    """`profile_prefill` (what ``--profile --device cuda`` measures on the GPU), here on the CPU
    at tiny widths: one sample per (chunk, prefix), positive, and a fit the scheduler loads."""
    from costmodel import CostModel
    from engine.checkpoint.generate import write_config_dir
    from services.bench._engine_costmodel import fit_cost_model, profile_prefill

    model = write_config_dir("tiny", tmp_path / "tiny", seed=0)
    # chunks 16 and 256: work that differs 16-fold, so a loaded machine's noise cannot make the
    # larger chunk look cheaper and leave the fit nothing to fit (the minimum of 3 timings)
    samples = profile_prefill(model, "cpu", (16, 256), (0, 300), repeats=3)
    assert sorted((c, h) for c, h, _ in samples) == [(16, 0), (16, 300), (256, 0), (256, 300)]
    assert all(t > 0 for _, _, t in samples)
    fit = fit_cost_model(samples)
    again = CostModel.from_json(fit["model"].to_json())
    assert again.predict(256, 300) == pytest.approx(fit["model"].predict(256, 300))


def test_the_fit_and_held_out_grids_alternate_and_keep_each_cells_minimum(tmp_path, monkeypatch) -> None:
    """`profile_fit_and_heldout`: rounds alternate fit, held-out, fit, ... (a host that slows
    down mid-profile slows both grids), every cell keeps its fastest round, and one runner
    serves both grids (it holds the longer of their positions)."""
    from engine.checkpoint.generate import write_config_dir
    from services.bench import _engine_costmodel as cm

    model = write_config_dir("tiny", tmp_path / "tiny", seed=0)
    built, timed = [], []
    monkeypatch.setattr(cm._Prefiller, "__init__", lambda self, d, dev, n: built.append(n))
    slow = {0: 2.0, 1: 2.0, 2: 1.0, 3: 3.0}  # the fit grid's fastest round is its second

    def time_grid(self, chunks, prefixes, repeats):
        timed.append(chunks)
        return [(c, h, slow[len(timed) - 1] * c) for h in prefixes for c in chunks]

    monkeypatch.setattr(cm._Prefiller, "time_grid", time_grid)
    fit, held = cm.profile_fit_and_heldout(model, "cpu", ((16, 64), (0, 300)), ((32,), (512,)), 1, 2)
    assert built == [544] and timed == [(16, 64), (32,), (16, 64), (32,)]
    assert fit == [(16, 0, 16.0), (64, 0, 64.0), (16, 300, 16.0), (64, 300, 64.0)]
    assert held == [(32, 512, 64.0)]  # min(2 x 32, 3 x 32)


def test_the_host_profile_names_where_a_steps_host_time_went() -> None:
    """`host_profile` (``--host-profile``): the step's own functions, largest first, in ms."""
    import time

    from services.bench._engine_prefill import host_profile

    def slow_part() -> None:
        time.sleep(0.02)

    def step() -> None:
        slow_part()
        sum(range(1000))

    out = host_profile(step, "cpu", top=5)
    names = [f["function"] for f in out["functions"]]
    assert len(names) <= 5 and "sleep" in names[0], names  # the builtin the step waited in
    own = [f["own_ms"] for f in out["functions"]]
    assert own == sorted(own, reverse=True) and own[0] >= 15
    assert out["profiled_ms"] >= own[0]
    assert any("slow_part" in n for n in [f["function"] for f in out["functions"]])


def test_the_pooling_ab_interleaves_the_kernel_off_and_on_and_restores_the_setting(monkeypatch) -> None:
    """`pooling_ab`: rounds of off then on, every size per variant, each step run with the
    variant its row names; the engine's setting is back afterwards."""
    from engine.kernels import pooling
    from services.bench import _engine_prefill as ep

    seen: list[bool] = []
    make = ep._runner

    def runner(a, blocks):
        r = make(a, blocks)
        run = r.execute
        r.execute = lambda batch: (seen.append(pooling.FUSED_POOLING), run(batch))[1]
        return r

    monkeypatch.setattr(ep, "_runner", runner)
    a = ep.PrefillArgs(device="cpu", dtype="float32", preset="tiny", layers=2, tokens=(16, 32), repeats=1,
                       transformers=False, tf_tokens=16, long_context=0, long_chunk=16, ab_rounds=2)  # fmt: skip
    setting = pooling.FUSED_POOLING
    rows = ep.pooling_ab(a)
    assert setting == pooling.FUSED_POOLING
    order = [(r["round"], r["pooling_kernel"], r["tokens"]) for r in rows]
    assert order == [(k, on, n) for k in (0, 1) for on in (False, True) for n in (16, 32)]
    assert all(r["ms"] > 0 and 0 < r["host_ms"] <= r["ms"] * 1.5 for r in rows)
    assert seen == [on for _ in (0, 1) for on in (False, True) for _n in (16, 32) for _r in range(2)]


def test_step_times_that_do_not_grow_with_the_work_are_refused_with_a_reason() -> None:
    """Noise larger than the work (a loaded machine, tiny chunks): larger chunks timed faster
    leave every term but the constant at 0; the fit says so instead of a model's own error."""
    from services.bench._engine_costmodel import fit_cost_model

    noise = [(16, 0, 0.026), (16, 300, 0.024), (64, 0, 0.0155), (64, 300, 0.0115)]
    with pytest.raises(ValueError, match="do not grow with the tokens"):
        fit_cost_model(noise)
    fit = fit_cost_model([(16, 0, 0.010), (16, 300, 0.013), (64, 0, 0.020), (64, 300, 0.026)])
    assert fit["model"].predict(64, 300) > fit["model"].predict(16, 0)
