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


def test_profiled_steps_read_caches_of_varied_entries(model):
    """`profile_decode` times steps over compressed caches of seeded random entries, not the
    zeros a fresh pool holds: the indexer sorts every entry's score each step, and sorting
    equal scores is several times faster than sorting a real cache's."""
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.runner import ModelRunner, RunnerConfig
    from services.bench.router import _fill_caches

    runner = ModelRunner.random(
        ModelConfig.from_dict(preset_config("tiny")),
        RunnerConfig(num_blocks=4, num_slots=1, with_mtp=False),
        seed=0,
    )
    stores = [*runner.pool.rows.values(), *runner.pool.index_rows.values()]
    assert runner.pool.index_rows and all(not s.any() for s in stores)  # a fresh pool: zeros
    _fill_caches(runner, seed=0)
    for s in stores:
        assert torch.isfinite(s).all() and s.std() > 0.5
    first = [s.clone() for s in stores]
    _fill_caches(runner, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first, stores))  # seeded


@pytest.mark.parametrize("speculative", [None, "fixed-2"])
def test_the_online_fit_bench_grades_each_model_on_each_workloads_steps(model, monkeypatch, speculative):
    """`sluice bench router --online-fit`, shrunk: a table, two served workloads, and every
    model graded on both (the refits in-sample no worse than where they started); with
    ``--speculative``, on the speculating engines' steps."""
    from services.bench import _decode_online as bench

    monkeypatch.setattr(bench, "CONCURRENCY", (1, 2))
    monkeypatch.setattr(
        bench, "WORKLOADS",
        {"short": {"prompt": (16, 64), "output": (6, 10)}, "long": {"prompt": (300, 600), "output": (4, 8)}},
    )  # fmt: skip
    monkeypatch.setattr(bench, "TABLE_BATCH", (1, 2))
    monkeypatch.setattr(bench, "TABLE_KV", (0, 1024))
    report = bench.run_online_fit(model, rounds=1, repeats=2, seed=0, speculative=speculative)
    assert report.config["speculative"] == speculative
    assert all(row["decode steps"] > 0 for row in report.rows[:2])
    errors = report.results["rel_rmse"]
    assert set(errors) == {"short", "long"}
    for wl, e in errors.items():
        assert report.results["served"][wl]["requests"] == 6  # 2 x c per phase: 2 + 4
        assert e[f"refit of default on {wl}"] <= e["default"]
        assert e[f"refit of table fit on {wl}"] <= e["table fit"]
    assert len(report.targets) == 6
    assert set(report.results["crossover_tokens"]) == set(report.results["models"])


class _Pushing:
    """What `DecodeSet.refit` reads of a decode engine: the stats it last pushed."""

    def __init__(self, sums) -> None:
        from services.api.engine_client import EngineStats

        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, extra=sums.to_extra())

    def stats(self):
        return self._stats


def test_the_decode_set_refits_its_engines_pooled_steps():
    """Placement keeps the default without a table; with one, it refits the table's fit
    keeping its d2, or all three where the engines speculate. The refit of all three
    coefficients is kept beside, for /metrics."""
    from costmodel.online import DecodeStepSums
    from services.ray.decode_set import DecodeSet

    true = DecodeCostModel(d0=0.012, d1=4e-4, d2=2e-7)
    engines = []
    for e in range(2):  # two engines, each with its own steps
        sums = DecodeStepSums()
        for b in range(1, 33):
            k = b * (300 + 200 * e + 40 * b)
            sums.add(b, k, true.step_time(b, k))
        engines.append(_Pushing(sums))
    table = DecodeCostModel(d0=0.006, d1=2e-4, d2=true.d2)  # forward passes only: no host work
    for prior in (None, table):
        decode = DecodeSet(engines, decode_cost=prior)
        assert decode.decode_cost == decode.refitted == (prior or DecodeCostModel())  # nothing read yet
        decode.refit()
        assert decode.steps.w == pytest.approx(64, rel=0.01)
        for term in ("d0", "d1", "d2"):
            assert getattr(decode.refitted, term) == pytest.approx(getattr(true, term), rel=0.05), (
                prior,
                term,
            )
        assert decode.policy.ctx.decode_cost is decode.decode_cost
    unprofiled = DecodeSet(engines)
    unprofiled.refit()
    assert unprofiled.decode_cost == DecodeCostModel()  # placement keeps the default
    placement = decode.decode_cost  # profiled: the table's d2, the host's d0 and d1 from the steps
    assert placement.d2 == table.d2
    assert placement.d0 == pytest.approx(true.d0, rel=0.05) and placement.d1 == pytest.approx(
        true.d1, rel=0.05
    )
    # speculating engines: a table of plain decode steps did not time their per-KV cost, so
    # placement refits all three around it (here the steps' d2 is 4x the table's)
    verifying = DecodeCostModel(d0=0.02, d1=3e-3, d2=4 * table.d2)
    spec_engines = []
    for e in range(2):
        sums = DecodeStepSums()
        for b in range(1, 33):
            k = b * (300 + 200 * e + 40 * b)
            sums.add(b, k, verifying.step_time(b, k))
        spec_engines.append(_Pushing(sums))
    speculating = DecodeSet(spec_engines, decode_cost=table, speculating=True)
    speculating.refit()
    assert speculating.decode_cost == speculating.refitted
    for term in ("d0", "d1", "d2"):
        assert getattr(speculating.decode_cost, term) == pytest.approx(getattr(verifying, term), rel=0.05), (
            term
        )
