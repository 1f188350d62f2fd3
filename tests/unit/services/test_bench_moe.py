"""`sluice bench moe`'s sweep: the space docs/benchmarks.md describes, holding the shipped tiles."""

from __future__ import annotations

from dataclasses import astuple

from engine.kernels.grouped import TUNED_GROUPED
from services.bench.moe import sweep_space


def test_the_sweep_times_32_distinct_configurations_and_the_shipped_one() -> None:
    space = sweep_space()
    assert len(space) == len(set(space)) == 32
    assert astuple(TUNED_GROUPED) in space
    assert all(bm in (64, 128) and bn in (64, 128, 256) and bk in (64, 128) for bm, bn, bk, *_ in space)
