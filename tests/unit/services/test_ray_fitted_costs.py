"""The Ray router's decode balancer prices steps with a model fitted to step times measured
beside the checkpoint (``sluice bench engine --profile --model DIR``), not hand-set ones."""

from __future__ import annotations

import json
import shutil

import pytest

from costmodel import DecodeCostModel
from engine.engine_config import DECODE_STEPS_FILE
from router.steptable import table_from_model
from services.ray.serving import PoolConfig, RayServingClient


@pytest.fixture
def model(checkpoint_factory, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint_factory("tiny"), out)
    return out


def test_the_decode_balancer_fits_the_measured_step_times_beside_the_checkpoint(model):
    client = RayServingClient(model, PoolConfig(1), PoolConfig(1))  # nothing starts: no Ray here
    assert client._fitted_decode_cost() is None  # nothing measured: the default model (and a warning)
    measured = DecodeCostModel(d0=0.002, d1=3e-4, d2=4e-8)
    table = table_from_model(measured, [1, 8, 64], [0, 4096, 65536])
    (model / DECODE_STEPS_FILE).write_text(table.to_json())
    fitted = client._fitted_decode_cost()
    assert fitted.step_time(16, 20_000) == pytest.approx(measured.step_time(16, 20_000), rel=1e-6)


def test_profile_decode_measures_a_checkpoint_directory(model):
    from router.steptable import StepTable
    from services.bench.router import profile_decode

    raw = profile_decode(model_dir=model, batches=(1, 2), kv_tokens=(0, 1024), rounds=1, repeats=2, warmup=1)
    assert raw["model"] == str(model) and raw["preset"] is None
    table = StepTable.from_dict(json.loads(json.dumps(raw)))
    assert all(t > 0 for row in raw["seconds"] for t in row)
    assert table.step_time(2, 1024) > 0
