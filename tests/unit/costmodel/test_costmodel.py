import json

import numpy as np
import pytest

from costmodel import CostModel, DecodeCostModel


def test_default_matches_seed_prefill_rate():
    # DeepInfer reports ~60,000 prefill tok/s/GPU at 4,096 tokens per rank
    m = CostModel()
    assert 4096 / m.predict(4096, 0) == pytest.approx(60_000, rel=1e-6)


def test_prefix_makes_steps_slower_and_quadratic_in_context():
    m = CostModel()
    assert m.predict(4096, 100_000) > 3 * m.predict(4096, 0)
    # prefill of 2L costs more than twice prefill of L (attention term)
    assert m.prefill_time(64_000) > 2.2 * m.prefill_time(32_000)


def test_prefill_time_is_sum_of_chunk_steps_and_cache_saves_work():
    m = CostModel(chunk_budget=1000)
    assert m.prefill_time(2500) == pytest.approx(
        m.predict(1000, 0) + m.predict(1000, 1000) + m.predict(500, 2000)
    )
    assert m.prefill_time(2500, cached=2000) == pytest.approx(m.predict(500, 2000))
    # a fully cached prompt still computes its last token
    assert m.prefill_time(2500, cached=2500) == pytest.approx(m.predict(1, 2499))


def test_fit_recovers_coefficients_and_roundtrips_json():
    true = CostModel(a=3e-10, b=2e-5, c=0.004)
    rng = np.random.default_rng(0)
    samples = [
        (c, h, true.predict(c, h) * (1 + rng.normal(0, 1e-3))) for c, h in rng.integers(1, 32768, (200, 2))
    ]
    fit = CostModel.fit(samples)
    assert fit.a == pytest.approx(true.a, rel=0.05)
    assert fit.b == pytest.approx(true.b, rel=0.05)
    assert fit.c == pytest.approx(true.c, rel=0.2)
    assert CostModel.from_json(fit.to_json()) == fit
    assert json.loads(fit.to_json())["kind"] == "prefill_quadratic"


def test_fit_and_config_validation():
    with pytest.raises(ValueError, match=">= 4 samples"):
        CostModel.fit([(1, 0, 1.0)])
    with pytest.raises(ValueError, match="do not vary"):
        CostModel.fit([(100, 0, 1.0)] * 5)
    with pytest.raises(ValueError, match="a >= 0|must be a finite"):
        CostModel(a=-1.0)
    with pytest.raises(ValueError, match="unknown CostModel fields"):
        CostModel.from_json('{"a": 1e-9, "b": 1e-5, "c": 0.0, "e": 1}')


def test_decode_model_fit_and_default_step():
    d = DecodeCostModel()
    # ~100 tok/s per user at 256 requests per rank (DeepInfer's figure), with 8K contexts
    assert 0.008 < d.step_time(256, 256 * 8192) < 0.012
    pts = [(b, k, 0.003 + 2e-5 * b + 1e-9 * k) for b in (1, 8, 64, 256) for k in (1e4, 1e6, 4e6)]
    fit = DecodeCostModel.fit(pts)
    assert fit.d1 == pytest.approx(2e-5, rel=1e-3) and fit.d2 == pytest.approx(1e-9, rel=1e-3)
    assert DecodeCostModel.from_json(fit.to_json()) == fit


def test_decode_fit_minimises_relative_error():
    """A step concave in the batch (routed experts overlap as it grows): the fit is graded by
    its relative error, so the small steps are not sacrificed to the large ones."""
    pts = [(b, k, 0.002 + 0.0004 * b**0.5 + 1e-9 * k) for b in (1, 4, 16, 64, 256) for k in (0, 1e6, 4e6)]
    fit = DecodeCostModel.fit(pts)
    worst = max(abs(fit.step_time(int(b), k) - t) / t for b, k, t in pts)
    x = np.array([(1.0, b, k) for b, k, _ in pts])
    absolute, *_ = np.linalg.lstsq(x, np.array([t for *_, t in pts]), rcond=None)
    worst_abs = max(abs(absolute @ (1.0, b, k) - t) / t for b, k, t in pts)
    assert worst < 0.2 < worst_abs
    with pytest.raises(ValueError, match="> 0"):
        DecodeCostModel.fit([(1, 0, 0.0), (2, 1, 1.0), (3, 5, 2.0)])


def test_costmodel_is_a_leaf_package():
    """The engine and the router both import it, so it must import neither (nor services, kvstore)."""
    import subprocess
    import sys

    code = (
        "import sys, costmodel\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'engine', 'router', 'services', 'kvstore'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
