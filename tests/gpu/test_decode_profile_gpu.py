"""The decode step table measured on the GPU (``sluice bench engine --profile --device cuda``):
bf16, CUDA graphs, synchronised timings; the decode balancer's cost model fits it."""

from __future__ import annotations

import json

import numpy as np
import torch


def test_profile_decode_on_cuda_runs_graphs_and_fits(tmp_path):
    from router.steptable import StepTable
    from services.bench.router import profile_decode

    raw = profile_decode(
        "small",
        batches=(1, 8, 64),
        kv_tokens=(0, 65_536, 262_144),
        rounds=1,
        repeats=3,
        warmup=2,
        device="cuda",
    )
    assert (raw["device"], raw["dtype"], raw["decode_graphs"]) == ("cuda", "bfloat16", True)
    assert raw["gpu"] == torch.cuda.get_device_name()
    table = StepTable.from_dict(raw)
    assert np.all(table.seconds > 0) and np.all(table.seconds < 1.0)
    model = table.fit()
    assert min(model.d0, model.d1, model.d2) >= 0 and model.step_time(64, 262_144) > model.step_time(1, 0)
    (tmp_path / "t.json").write_text(json.dumps(raw))
    assert StepTable.load(tmp_path / "t.json").seconds.shape == (3, 3)


def test_profile_prefill_on_cuda_fits_the_chunk_cost_model(tmp_path):
    """The prefill half of ``--profile --device cuda``: bf16 step times over (chunk, prefix) on
    the GPU, fitted to the chunk cost model the scheduler and the router load."""
    from costmodel import CostModel
    from engine.checkpoint.generate import write_config_dir
    from services.bench._engine_costmodel import fit_cost_model, profile_prefill

    model = write_config_dir("small", tmp_path / "small", seed=0)
    samples = profile_prefill(model, "cuda", (512, 2048, 8192), (0, 4096, 16384), repeats=3)
    assert len(samples) == 9 and all(0 < t < 5.0 for _, _, t in samples)
    fit = fit_cost_model(samples)
    print(f"small on {torch.cuda.get_device_name()}: prefill fit rel RMSE {fit['fit_rel_rmse']:.3f}")
    model_json = fit["model"].to_json()
    assert CostModel.from_json(model_json).predict(8192, 16384) > CostModel.from_json(model_json).predict(
        512, 0
    )


def test_the_spec_profile_is_measured_on_the_gpu_and_named_after_it(tmp_path):
    """The speculative half of ``--profile --device cuda --model DIR`` (a checkpoint with an MTP
    layer): its step profile measured on this GPU, saved under this GPU model's name, where a
    DSpark engine on this GPU loads it."""
    import argparse
    from pathlib import Path

    from engine.spec.profile import SpecProfile, spec_steps_file
    from services.bench.engine import _profile_spec

    trained = Path(__file__).resolve().parents[2] / "models" / "trained"
    model = tmp_path / "trained"
    model.mkdir()
    for f in trained.iterdir():
        if not f.name.startswith("sluice_spec_steps"):
            (model / f.name).symlink_to(f)
    args = argparse.Namespace(device="cuda", dtype=None)
    out = _profile_spec(model, args, batches=(1, 8), drafted=2, prompt_tokens=64, warmup=1, steps=2, rounds=1)
    assert out is not None and out.name == spec_steps_file(torch.cuda.get_device_name())
    prof = SpecProfile.load(out)
    assert prof.batch == (1, 8) and all(s > 0 for row in prof.seconds for s in row)
