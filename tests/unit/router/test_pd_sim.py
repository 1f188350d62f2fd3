"""``router.pd_sim``: step times, TTFT and TPOT on cases small enough to check by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.pd_sim import SLO, PDConfig, PDResult, PDSimulator, StepModel, SweepPoint, SweepResult, feasible
from router.policy import PolicyContext, RoundRobin
from router.trace import Trace

C, D, D1, D2 = 0.1, 0.001, 0.002, 1e-5
STEP = StepModel(c=C, d=D, d1=D1, d2=D2)


def trace(rows: list[tuple[float, int, int]], shared: bool = False) -> Trace:
    """(arrival s, input tokens, output tokens) rows; blocks distinct per request unless ``shared``."""
    blocks = []
    for i, (_, n_in, _) in enumerate(rows):
        n = -(-n_in // 512)
        blocks.append(tuple(range(n)) if shared else tuple(i * 1000 + j for j in range(n)))
    return Trace(
        "t",
        np.array([r[0] for r in rows], dtype=np.float64),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        tuple(blocks),
        512,
    )


def run(tr: Trace, mode: str, **kw: object) -> PDResult:
    cfg = PDConfig(mode=mode, step=kw.pop("step", STEP), **kw)  # type: ignore[arg-type]
    n_pre = cfg.num_colocated if mode == "colocated" else cfg.num_prefill
    pre = RoundRobin(PolicyContext(n_pre))
    dec = RoundRobin(PolicyContext(cfg.num_decode)) if mode == "disaggregated" else None
    return PDSimulator(tr, cfg, pre, dec).run()


ONE = {"num_prefill": 1, "num_decode": 1, "num_colocated": 1}


def test_step_model_terms() -> None:
    m = StepModel(c=1.0, d=2.0, a=3.0, b=4.0, d1=5.0, d2=6.0)
    assert m.step_time([(2, 3)], 0, 0.0) == 1.0 + 2.0 * 2 + 3.0 * 2 * 5 + 4.0 * 5
    assert m.decode_step(7, 10.0) == 1.0 + 5.0 * 7 + 6.0 * 10
    assert m.step_time([(1, 0), (1, 0)], 1, 1.0) == 1.0 + 2 * (2.0 + 3.0 + 4.0) + 5.0 + 6.0
    assert m.cost_model(100).prefill_time(50) == pytest.approx(m.step_time([(50, 0)], 0, 0.0))
    assert m.decode_cost_model().step_time(7, 10.0) == m.decode_step(7, 10.0)
    with pytest.raises(ValueError, match="StepModel.d1"):
        StepModel(c=1.0, d=1.0, d1=-1.0)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_one_request_ttft_is_its_prefill(mode: str) -> None:
    res = run(trace([(0.0, 1000, 1)]), mode, **ONE)
    assert res.ttft_s[0] == pytest.approx(C + D * 1000)
    assert math.isnan(res.tpot_s[0])  # one output token: no TPOT


def test_chunked_prefill_pays_the_fixed_cost_per_chunk() -> None:
    res = run(trace([(0.0, 1000, 1)]), "colocated", prefill_budget=300, **ONE)
    assert res.ttft_s[0] == pytest.approx(4 * C + D * 1000)  # 300 + 300 + 300 + 100
    m = StepModel(c=C, d=D, a=1e-7)
    res = run(trace([(0.0, 1000, 1)]), "colocated", prefill_budget=300, step=m, **ONE)
    pairs = 300 * 300 + 300 * 600 + 300 * 900 + 100 * 1000
    assert res.ttft_s[0] == pytest.approx(4 * C + D * 1000 + 1e-7 * pairs)


def test_disaggregated_tpot_holds_the_handoff() -> None:
    # 1,000 bytes per token + 500 per sequence over 1 MB/s: 1.5 s for 1,000 tokens
    cfg = {"handoff_bytes_per_token": 1000.0, "handoff_fixed_bytes": 500_000.0, "link_bytes_per_s": 1e6}
    res = run(trace([(0.0, 1000, 5)]), "disaggregated", **ONE, **cfg)
    dt = C + D1 + D2 * 1000
    assert res.handoff_s[0] == pytest.approx(1.5)
    assert res.ttft_s[0] == pytest.approx(C + D * 1000)
    assert res.tpot_s[0] == pytest.approx((1.5 + 4 * dt) / 4)


def test_colocated_decode_steps_right_after_the_prefill() -> None:
    res = run(trace([(0.0, 1000, 5)]), "colocated", **ONE)
    assert res.tpot_s[0] == pytest.approx(C + D1 + D2 * 1000)


def test_colocated_prefill_joins_the_decode_step_in_progress() -> None:
    # A decodes 10 steps; B arrives halfway through A's first decode step, waits for it to end,
    # then its prefill runs in one step with A's decode (one fixed cost for both)
    t1 = C + D * 100
    dt_a = C + D1 + D2 * 100
    res = run(trace([(0.0, 100, 11), (t1 + 0.5 * dt_a, 200, 1)]), "colocated", **ONE)
    mixed = C + D * 200 + D1 + D2 * 100
    assert res.ttft_s[1] == pytest.approx(0.5 * dt_a + mixed)
    # A: 10 decode steps, one of them the mixed step
    assert res.tpot_s[0] == pytest.approx((9 * dt_a + mixed) / 10)


def test_a_prefill_step_packs_queued_requests() -> None:
    # the first starts a step at once; the two arriving during it share the next step
    res = run(trace([(0.0, 300, 1), (0.01, 300, 1), (0.01, 500, 1)]), "disaggregated", **ONE)
    first = C + D * 300
    assert res.ttft_s.tolist() == pytest.approx([first] + [first - 0.01 + C + D * 800] * 2)


def test_max_batch_makes_the_third_sequence_wait() -> None:
    # prefills: #0 alone (0.2 s), then #1 and #2 together (done at 0.5 s); decode one at a time
    res = run(trace([(0.0, 100, 3)] * 3), "disaggregated", max_batch=1, **ONE)
    dt = C + D1 + D2 * 100
    assert res.ttft_s.tolist() == pytest.approx([0.2, 0.5, 0.5])
    assert res.tpot_s[:2].tolist() == pytest.approx([dt, dt])
    assert res.tpot_s[2] == pytest.approx(4 * dt / 2)  # waits two steps of #1, then its own two


def test_prefix_cache_hit_shortens_the_second_prefill() -> None:
    res = run(trace([(0.0, 1024, 1), (10.0, 1100, 1)], shared=True), "disaggregated", **ONE)
    assert res.cached_tokens.tolist() == [0, 1024]
    assert res.ttft_s[1] == pytest.approx(C + D * 76)


def test_deterministic() -> None:
    rng = np.random.default_rng(0)
    rows = [(float(t), int(n), int(o)) for t, n, o in zip(
        np.sort(rng.uniform(0, 20, 60)), rng.integers(100, 5000, 60), rng.integers(1, 40, 60)
    )]  # fmt: skip
    tr = trace(rows)
    for mode in ("disaggregated", "colocated"):
        kw = {"num_prefill": 3, "num_decode": 2, "num_colocated": 5, "prefill_budget": 2048}
        a, b = run(tr, mode, **kw), run(tr, mode, **kw)
        assert np.array_equal(a.ttft_s, b.ttft_s) and np.array_equal(a.tpot_s, b.tpot_s, equal_nan=True)
        assert a.steps == b.steps and np.all(np.isfinite(a.ttft_s))


def test_goodput_interpolates_in_log_rate() -> None:
    def pt(rate: float, feas: float, att: float) -> SweepPoint:
        return SweepPoint(rate, att, feas, rate * att, 0.0, 0.0, 0.0, 0.0, 0.0, 0)

    sw = SweepResult([pt(1.0, 1.0, 0.8), pt(4.0, 0.0, 0.0)])
    assert sw.goodput_rate(0.5) == pytest.approx(2.0)  # halfway in log rate
    assert sw.goodput(0.5) == pytest.approx(2.0 * 0.4)
    assert SweepResult([pt(1.0, 0.4, 0.4)]).goodput_rate(0.5) == 0.0
    assert SweepResult([pt(1.0, 0.9, 0.9), pt(2.0, 0.95, 0.9)]).goodput_rate(0.5) == 2.0


def test_slo_and_feasible() -> None:
    tr = trace([(0.0, 1000, 5), (0.0, 5000, 1)])
    res = PDResult(
        np.array([1.0, 3.0]), np.array([0.2, np.nan]), np.zeros(2, dtype=np.int64), np.zeros(2),
        np.zeros(2), np.zeros(2), 0, 0.0,
    )  # fmt: skip
    slo = SLO(2.0, 0.3)
    assert slo.met(res, tr.output_len).tolist() == [True, False]
    ok = feasible(tr, STEP.cost_model(32768), slo, STEP.decode_step(1, 0))
    assert ok.tolist() == [True, False]  # 0.1 + 1 s fits, 0.1 + 5 s does not
