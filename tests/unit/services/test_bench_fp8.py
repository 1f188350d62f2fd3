"""`sluice bench fp8`: its cases at flash-shape widths, and a clear refusal without a GPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.checkpoint.presets import preset_config
from services.bench import fp8


def test_the_cases_are_the_models_products() -> None:
    cases = {c[0]: c[1:] for c in fp8._cases(preset_config("flash-shape"), 4096, 64)}
    # 6 of 256 experts per token: 96 rows each at 4,096 tokens, 1.5 at 64 requests
    assert cases["experts gate_up, prefill"] == (256, 4096 * 6, 4096, 4096)
    assert cases["experts down, prefill"] == (256, 4096 * 6, 4096, 2048)
    assert cases["q_b, prefill"] == (1, 4096, 32768, 1024)
    assert cases["o_b, prefill"] == (1, 4096, 4096, 8192)
    assert cases["q_b, decode"] == (1, 64, 32768, 1024)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_what_it_needs() -> None:
    p = argparse.ArgumentParser()
    fp8.add_arguments(p)
    with pytest.raises(SystemExit, match="CUDA device with Triton"):
        fp8.run(p.parse_args([]))


def test_a_reports_table_reaches_its_json() -> None:
    """The printed table is in ``--json`` too (the fp8 bench's first GPU run lost its cases:
    they were only in the table)."""
    from services.bench import Report

    report = Report("fp8", {})
    report.rows.append({"case": "q_b, decode", "bf16 ms": 0.026})
    assert report.to_json()["rows"] == [{"case": "q_b, decode", "bf16 ms": 0.026}]
