"""`sluice bench hyper --device cpu`: the eager Sinkhorn through torch and numpy, per row count."""

from __future__ import annotations

import argparse

from engine.model import hyper as hyper_model
from services.bench import hyper


def test_the_cpu_sinkhorn_table_times_both_paths_and_finds_them_bitwise_equal() -> None:
    p = argparse.ArgumentParser()
    hyper.add_arguments(p)
    limit = hyper_model.NUMPY_SINKHORN_ELEMENTS
    report = hyper.run(p.parse_args(["--device", "cpu", "--repeats", "2"]))
    assert limit == hyper_model.NUMPY_SINKHORN_ELEMENTS  # restored
    rows = report.results["cpu_sinkhorn"]
    assert [r["rows"] for r in rows] == list(hyper.SINKHORN_ROWS)
    assert all(r["torch us"] > 0 and r["numpy us"] > 0 and r["bitwise equal"] for r in rows)
    assert {r["engine takes"] for r in rows} == {"numpy", "torch"}  # the threshold inside the range
