"""The chunk cost model fitted by ``sluice bench engine --profile``: all four terms of
``costmodel.CostModel``, each >= 0, by least squares on relative error."""

from __future__ import annotations

import pytest

from costmodel import CostModel
from services.bench import _engine_costmodel as grids
from services.bench._engine_costmodel import (
    GRID_C,
    GRID_H,
    HELDOUT_C,
    HELDOUT_H,
    fit_cost_model,
    heldout_error,
)


def _grid(model: CostModel) -> list[tuple[int, int, float]]:
    return [(c, h, model.predict(c, h)) for h in GRID_H for c in GRID_C]


def test_a_model_of_the_form_is_recovered() -> None:
    truth = CostModel(a=3e-8, b=2e-6, c=0.004, d=5e-5)
    fit = fit_cost_model(_grid(truth))
    for name in ("a", "b", "c", "d"):
        assert fit[name] == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit["fit_rel_rmse"] < 1e-9


def test_a_step_linear_in_new_tokens_fits_without_borrowing_a_default() -> None:
    """The CPU engine's steps after the bounded-attention prefill: time ~ c + d*C, flat in
    the prefix. The old three-term fit had no d and took CostModel's H200 default for it."""
    truth = CostModel(a=0.0, b=0.0, c=0.023, d=2.9e-4)
    fit = fit_cost_model(_grid(truth))
    assert fit["model"].d == pytest.approx(2.9e-4, rel=1e-6) and fit["fit_rel_rmse"] < 1e-9


def test_negative_terms_are_left_out_not_clipped_after_thefit_cost_model() -> None:
    """Time that falls with the prefix cannot be fitted with b >= 0: the fit drops b and fits
    the rest, every coefficient >= 0."""
    samples = [(c, h, 0.01 + 1e-4 * c - 2e-6 * h) for h in GRID_H for c in GRID_C]
    fit = fit_cost_model(samples)
    assert min(fit["a"], fit["b"], fit["c"], fit["d"]) >= 0
    assert fit["b"] == 0 and fit["d"] > 0 and fit["fit_rel_rmse"] < 0.1


@pytest.mark.parametrize(
    "grid, held",
    [
        ((GRID_C, GRID_H), (HELDOUT_C, HELDOUT_H)),
        ((grids.GPU_GRID_C, grids.GPU_GRID_H), (grids.GPU_HELDOUT_C, grids.GPU_HELDOUT_H)),
    ],
)
def test_held_out_shapes_share_no_chunk_and_no_prefix_with_the_fit(grid, held) -> None:
    assert not set(grid[0]) & set(held[0]) and not set(grid[1]) & set(held[1])
    assert max(held[1]) > max(grid[1])  # beyond the longest prefix fitted: extrapolation is tested


def test_the_held_out_error_is_the_models_relative_error_there() -> None:
    truth = CostModel(a=3e-8, b=2e-6, c=0.004, d=5e-5)
    model = fit_cost_model(_grid(truth))["model"]
    held = [(c, h, truth.predict(c, h)) for h in HELDOUT_H for c in HELDOUT_C]
    assert heldout_error(model, held)["heldout_rel_rmse"] < 1e-9
    slow = [(c, h, t / 2) for c, h, t in held]  # steps twice as fast as predicted: error 1.0
    err = heldout_error(model, slow)
    assert err["heldout_rel_rmse"] == pytest.approx(1.0) and err["heldout_max_rel_err"] == pytest.approx(1.0)
    assert err["heldout_samples_chunk_prefix_s"] == [list(x) for x in slow]
