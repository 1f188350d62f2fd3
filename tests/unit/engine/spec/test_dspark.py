"""DSpark scheduling core: survival, greedy admission vs brute force, baselines, profile,
policy choice, lagged confidences and the simulator."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from engine.spec.dspark import (
    FEW_REQUESTS,
    choose_policy,
    expected_accepted,
    expected_total,
    fixed_k_from_means,
    plan_dspark,
    plan_dspark_depths,
    select_dspark,
    select_fixed,
    select_oracle,
    survival,
)
from engine.spec.lagged import LaggedConfidence
from engine.spec.simulate import SyntheticConfig, generate, roofline_seconds, simulate
from engine.spec.step_table import StepProfile, monotone_fit, throughput

# ----------------------------------------------------------------------------- helpers


def _random_profile(rng: np.random.Generator, max_tokens: int = 20) -> StepProfile:
    n = int(rng.integers(1, 6))
    pts = np.sort(rng.choice(np.arange(1, max_tokens + 1), size=n, replace=False))
    rates = np.sort(rng.uniform(0.2, 1.0, size=n))[::-1]
    if rng.random() < 0.3:  # plateaus and steep drops too
        rates = np.round(rates, 1)
    return StepProfile(pts, rates)


def _random_conf(rng: np.random.Generator, batch: int) -> list[np.ndarray]:
    out = []
    for _ in range(batch):
        n = int(rng.integers(0, 6))
        c = rng.uniform(0, 1, size=n)
        c[rng.random(n) < 0.15] = 1.0  # ties in survival within a request
        c[rng.random(n) < 0.05] = 0.0
        out.append(c)
    return out


def _brute(conf: list[np.ndarray], profile: StepProfile, max_tokens: int | None = None):
    """(best throughput, {D: best sum E with sum k = D}) over every prefix choice."""
    best = -1.0
    best_e: dict[int, float] = {}
    for ks in itertools.product(*(range(len(c) + 1) for c in conf)):
        tokens = sum(k + 1 for k in ks)
        if max_tokens is not None and tokens > max(max_tokens, len(conf)):
            continue
        e = expected_total(conf, ks)
        best = max(best, throughput(e, tokens, profile))
        d = sum(ks)
        best_e[d] = max(best_e.get(d, -1.0), e)
    return best, best_e


# ----------------------------------------------------------------------------- survival


def test_survival_is_cumulative_product_and_expected_accepted():
    a = survival([0.9, 0.5, 1.0, 0.2])
    np.testing.assert_allclose(a, [0.9, 0.45, 0.45, 0.09])
    assert expected_accepted(a, 0) == 1.0
    assert expected_accepted(a, 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_accepted(a, 4) == pytest.approx(1 + 0.9 + 0.45 + 0.45 + 0.09)
    with pytest.raises(ValueError):
        expected_accepted(a, 5)
    for bad in ([1.2], [-0.1], [np.nan]):
        with pytest.raises(ValueError):
            survival(bad)
    assert expected_total([[0.5, 0.5], []], [2, 0]) == pytest.approx(2 + 0.5 + 0.25)
    with pytest.raises(ValueError):
        expected_total([[0.5], []], [1, 1])  # more than the drafts available


# ----------------------------------------------------------------------------- optimality


def test_greedy_equals_brute_force_optimum_on_small_random_cases():
    """The argmax over greedy prefixes is the global optimum over all {k_r} (prefixes)."""
    rng = np.random.default_rng(1)
    for _ in range(150):
        batch = int(rng.integers(1, 4))
        conf = _random_conf(rng, batch)
        profile = _random_profile(rng)
        max_tokens = int(rng.integers(batch, 3 * batch + 4)) if rng.random() < 0.3 else None
        plan = plan_dspark(conf, profile, max_tokens=max_tokens)
        best, _ = _brute(conf, profile, max_tokens)
        # the plan's own prediction is consistent with its ks ...
        assert all(0 <= k <= len(c) for k, c in zip(plan.ks, conf))
        assert plan.tokens == int((plan.ks + 1).sum())
        if max_tokens is not None:
            assert plan.tokens <= max(max_tokens, batch)
        assert plan.expected_accepted == pytest.approx(expected_total(conf, plan.ks))
        assert plan.throughput == pytest.approx(throughput(plan.expected_accepted, plan.tokens, profile))
        # ... and no prefix choice beats it
        assert plan.throughput == pytest.approx(best, rel=1e-12), (conf, profile)


def test_greedy_prefix_of_size_d_maximises_expected_tokens_for_that_d():
    """For every D, the D largest survivals are prefix-closed and the best E at T = B + D."""
    rng = np.random.default_rng(2)
    flat = StepProfile([1], [1.0])  # throughput = E: argmax takes every draft
    for _ in range(100):
        conf = _random_conf(rng, int(rng.integers(1, 4)))
        _, best_e = _brute(conf, flat)
        n = sum(len(c) for c in conf)
        for d in range(n + 1):
            ks = plan_dspark(conf, flat, max_tokens=len(conf) + d).ks
            assert ks.sum() <= d  # fewer only when the rest add nothing (zero survivals)
            assert expected_total(conf, ks) == pytest.approx(best_e[d], rel=1e-12)


def test_the_plans_at_every_depth_equal_one_plan_per_depth():
    """`plan_dspark_depths` sorts once for every drafting depth; each of its plans equals
    `plan_dspark` over that many drafts with that depth's table, to the bit (one request,
    ties and zero survivals included; in plain Python up to `FEW_REQUESTS` requests, with
    arrays above)."""
    rng = np.random.default_rng(4)
    for _ in range(120):
        batch = int(rng.integers(1, FEW_REQUESTS + 9))
        conf = rng.uniform(0.0, 1.0, size=(batch, 5))
        if rng.random() < 0.3:
            conf = np.round(conf, 1)  # ties and zeros
        tables = [_random_profile(rng, max_tokens=6 * batch) for _ in range(int(rng.integers(1, 6)))]
        for d, got in enumerate(plan_dspark_depths(conf, tables), start=1):
            want = plan_dspark(conf[:, :d], tables[d - 1])
            assert got.ks.tolist() == want.ks.tolist()
            assert (got.expected_accepted, got.tokens, got.throughput) == (
                want.expected_accepted, want.tokens, want.throughput,
            )  # fmt: skip
    for got in plan_dspark_depths(np.zeros((0, 5)), [StepProfile([1], [1.0])] * 3):  # no request
        assert (got.ks.tolist(), got.expected_accepted, got.tokens, got.throughput) == ([], 0.0, 0, 0.0)
    with pytest.raises(ValueError, match="K >= 3"):
        plan_dspark_depths(np.full((2, 2), 0.5), [StepProfile([1], [1.0])] * 3)


def test_first_peak_stop_matches_argmax_for_affine_step_time():
    """seconds(T) = c0 + c1 T makes greedy-prefix throughput unimodal: stopping at the
    first non-increase is optimal. A profile with a plateau after a drop breaks that."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        batch = int(rng.integers(1, 4))
        conf = _random_conf(rng, batch)
        c0, c1 = rng.uniform(0.5, 2.0), rng.uniform(0.01, 1.0)
        profile = StepProfile.from_cost_model(lambda t, c0=c0, c1=c1: c0 + c1 * t, range(1, 20))
        fp = plan_dspark(conf, profile, stop="first_peak")
        best, _ = _brute(conf, profile)
        assert fp.throughput == pytest.approx(best, rel=1e-12)
    # counterexample: a big drop at T=2 then flat; first_peak stops at D=0, argmax goes on
    conf = [np.array([0.9, 0.9, 0.9, 0.9, 0.9])]
    profile = StepProfile([1, 2, 6], [1.0, 0.5, 0.5])
    assert select_dspark(conf, profile, stop="first_peak") == [0]
    assert select_dspark(conf, profile) == [5]


def test_dspark_prefers_confident_requests_and_respects_cap():
    conf = np.array([[0.99, 0.99, 0.99], [0.1, 0.1, 0.1]])
    # each extra token costs 10 % of a step's rate: only the confident drafts pay
    profile = StepProfile.from_cost_model(lambda t: 1.0 + 0.1 * t, range(1, 10))
    assert select_dspark(conf, profile) == [3, 0]
    assert select_dspark(conf, profile, max_tokens=3) == [1, 0]
    assert select_dspark(conf, profile, max_tokens=1) == [0, 0]  # never below B
    assert select_dspark([], profile) == []
    assert select_dspark([[], []], profile) == [0, 0]
    with pytest.raises(ValueError):
        select_dspark(conf, profile, stop="later")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- baselines


def test_fixed_and_oracle():
    assert select_fixed([5, 2, 0, 5], 3) == [3, 2, 0, 3]
    assert select_fixed([5, 2], 0) == [0, 0]
    assert select_oracle([0, 3, 5]) == [0, 3, 5]
    assert select_oracle([4, 3], n_drafts=[2, 5]) == [2, 3]
    with pytest.raises(ValueError):
        select_fixed([1], -1)
    with pytest.raises(ValueError):
        select_oracle([-1])


# ----------------------------------------------------------------------------- profile


def test_profile_interpolation_clamping_and_round_trip():
    p = StepProfile([10, 20, 40], [100.0, 80.0, 40.0])
    assert p.steps_per_s(10) == 100.0
    assert p.steps_per_s(15) == pytest.approx(90.0)
    assert p.steps_per_s(30) == pytest.approx(60.0)
    assert p.steps_per_s(1) == 100.0  # clamped below
    assert p.steps_per_s(1000) == 40.0  # clamped above
    np.testing.assert_allclose(p.steps_per_s(np.array([15, 30])), [90.0, 60.0])
    assert p.seconds(30) == pytest.approx(1 / 60.0)
    assert throughput(120.0, 30, p) == pytest.approx(7200.0)
    q = StepProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p
    c = StepProfile.from_cost_model(lambda t: 0.01 + 0.001 * t, [20, 10, 10, 40])
    assert c.tokens == (10.0, 20.0, 40.0)
    assert c.steps_per_s(20) == pytest.approx(1 / 0.03)


def test_monotone_fit_is_the_least_squares_non_decreasing_fit():
    """A cell read high by noise is pooled with its larger neighbour, not carried upward: a
    running maximum would price every larger step at the outlier."""
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # already monotone: unchanged
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone_fit([5.0, 4.0, 3.0]) == [4.0, 4.0, 4.0]
    assert monotone_fit([]) == []
    rng = np.random.default_rng(0)
    for _ in range(200):  # no random non-decreasing candidate, nor a nearby one, is closer
        v = rng.normal(size=6).round(2)
        fit = np.array(monotone_fit(v))
        assert np.all(np.diff(fit) >= -1e-12) and fit.mean() == pytest.approx(v.mean())
        for _ in range(50):
            other = np.sort(rng.normal(size=6))
            assert ((fit - v) ** 2).sum() <= ((other - v) ** 2).sum() + 1e-12
        nudged = fit + 1e-3 * rng.normal(size=6)  # a nearby monotone sequence is no closer
        if np.all(np.diff(nudged) >= 0):
            assert ((fit - v) ** 2).sum() <= ((nudged - v) ** 2).sum() + 1e-12


@pytest.mark.parametrize(
    "tokens,rates",
    [
        ([], []),
        ([1, 2], [1.0]),
        ([2, 1], [1.0, 1.0]),  # not increasing
        ([1, 1], [1.0, 1.0]),
        ([0, 1], [1.0, 1.0]),  # non-positive tokens
        ([1, 2], [1.0, 2.0]),  # faster when bigger
        ([1, 2], [1.0, 0.0]),  # non-positive rate
        ([1, 2], [1.0, float("inf")]),
    ],
)
def test_profile_validation(tokens, rates):
    with pytest.raises(ValueError):
        StepProfile(tokens, rates)


# ----------------------------------------------------------------------------- choose_policy


def _mixed_conf(batch: int = 8) -> np.ndarray:
    hi = np.full((batch // 2, 5), 0.95)
    lo = np.full((batch - batch // 2, 5), 0.2)
    return np.concatenate([hi, lo])


def test_choose_policy_by_profile_cost():
    conf = _mixed_conf()
    free = StepProfile([1], [1.0])  # extra tokens cost nothing: verify everything, uniformly
    ks, name = choose_policy(conf, free)
    assert (ks, name) == ([5] * 8, "fixed-K")
    steep = StepProfile.from_cost_model(lambda t: 2.0**t, range(1, 60))  # doubling per token
    ks, name = choose_policy(conf, steep)
    assert (ks, name) == ([0] * 8, "none")
    # moderate: each token costs 2 % of a step; selection (only confident drafts) pays
    moderate = StepProfile.from_cost_model(lambda t: 1.0 + 0.02 * t, range(1, 60))
    ks, name = choose_policy(conf, moderate)
    assert name == "dspark"
    assert ks == select_dspark(conf, moderate)
    assert all(k > 0 for k in ks[:4]) and all(k == 0 for k in ks[4:])
    assert fixed_k_from_means(conf, moderate) < 5
    # nearly free tokens: selection drops only the weakest drafts, a gain below the margin
    nearly = StepProfile.from_cost_model(lambda t: 1.0 + 3e-4 * t, range(1, 60))
    assert select_dspark(conf, nearly) != [5] * 8
    assert choose_policy(conf, nearly) == ([5] * 8, "fixed-K")
    assert choose_policy(conf, nearly, margin=0.0)[1] == "dspark"
    assert choose_policy(conf, moderate, margin=10.0)[1] == "fixed-K"
    # a large enough per-step overhead of the selection path hands it back to fixed-K
    _, name = choose_policy(conf, moderate, dspark_overhead_s=10.0)
    assert name in ("fixed-K", "none")
    assert choose_policy(conf, moderate, max_k=0) == ([0] * 8, "none")
    assert choose_policy([], moderate) == ([], "none")


# ----------------------------------------------------------------------------- lagged


def test_lagged_confidence_returns_two_steps_old_with_fallback():
    lag = LaggedConfidence(lag=2, prior=0.7)
    # nothing recorded anywhere: the prior
    np.testing.assert_allclose(lag.get("a", 3), [0.7, 0.7, 0.7])
    lag.record("a", [0.9, 0.8, 0.7])
    assert lag.age("a") == 1
    np.testing.assert_allclose(lag.get("a", 3), [0.7, 0.7, 0.7])  # one step old only: prior
    lag.record("a", [0.5, 0.4, 0.3])
    np.testing.assert_allclose(lag.get("a", 3), [0.9, 0.8, 0.7])  # two steps old
    lag.record("a", [0.1, 0.1, 0.1])
    np.testing.assert_allclose(lag.get("a", 3), [0.5, 0.4, 0.3])
    np.testing.assert_allclose(lag.get("a", 2), [0.5, 0.4])
    # a young request falls back to the population mean of lagged confidences, then prior
    lag.record("b", [0.3])
    lag.record("b", [0.3])
    lag.record("b", [0.3])  # b's lagged is [0.3] (one position)
    lag.record("c", [0.2, 0.2, 0.2, 0.2])
    np.testing.assert_allclose(lag.get("c", 4), [0.4, 0.4, 0.3, 0.7])
    np.testing.assert_allclose(lag.get("b", 3), [0.3, 0.4, 0.3])  # missing positions filled
    lag.drop("a")
    assert lag.age("a") == 0 and len(lag) == 2
    np.testing.assert_allclose(lag.get("c", 2), [0.3, 0.7])
    assert [x.size for x in lag.get_batch(["b", "c"], [1, 0])] == [1, 0]
    with pytest.raises(ValueError):
        LaggedConfidence(lag=0)


# ----------------------------------------------------------------------------- simulator


def test_simulator_seeded_invariants():
    cfg = SyntheticConfig(batch=24, steps=120, sigma_conf=0.0, seed=7)
    trace = generate(cfg)
    assert trace.conf.shape == (120, 24, 5) and trace.accepted.shape == (120, 24)
    assert trace.accepted.min() >= 0 and trace.accepted.max() <= 5
    assert np.all((trace.conf > 0) & (trace.conf < 1))
    assert len(np.unique(trace.rid)) > 24  # turnover happened
    np.testing.assert_array_equal(generate(cfg).accepted, trace.accepted)  # seeded
    profile = StepProfile.from_cost_model(roofline_seconds(0.02, 64, 5e-4), [1, 64, 128, 256])
    res = {r.name: r for r in simulate(trace, profile)}
    oracle = res["oracle"]
    assert oracle.verified_per_accepted == pytest.approx(1.0)
    assert res["none"].accepted_length == 1.0 and res["none"].verified_per_step == 24
    assert res["fixed-5"].accepted_length == pytest.approx(oracle.accepted_length)
    for name, r in res.items():
        # the oracle accepts the most possible tokens; nothing accepts more than it verifies
        assert r.accepted_length <= oracle.accepted_length + 1e-12, name
        assert r.verified_per_accepted >= 1.0 - 1e-12, name
        # hindsight (best choice per step given the outcomes) bounds every per-step throughput
        assert r.step_throughput <= res["hindsight"].step_throughput * (1 + 1e-12), name
    fixed = [res[f"fixed-{k}"].throughput for k in range(1, 6)]
    # seeded, calibrated confidences: selection beats every fixed K and no speculation
    assert res["dspark"].throughput > max(fixed) > res["none"].throughput
    assert res["dspark"].throughput > res["dspark-async"].throughput  # stale confidences cost
    assert sum(res["auto"].choices.values()) == 120
    # where every extra token halves the step rate, hindsight verifies no draft at all
    steep = StepProfile.from_cost_model(lambda t: 2.0**t, range(1, 200))
    o, h = simulate(trace, steep, ["oracle", "hindsight"])
    assert h.verified_per_step == 24 and o.verified_per_step > 24
    assert h.step_throughput > o.step_throughput
    with pytest.raises(ValueError):
        simulate(trace, steep, ["fixed-x"])


def test_select_dspark_speed_b128():
    """Loose bound (measured ~0.05-0.2 ms on the dev machine; the target is < 1 ms)."""
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, size=(128, 5))
    rows = list(conf)
    profile = StepProfile.from_cost_model(roofline_seconds(0.02, 256, 1e-4), [1, 256, 512, 1024])
    for c in (conf, rows):
        plan_dspark(c, profile)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            plan_dspark(c, profile)
            times.append(time.perf_counter() - t0)
        assert min(times) < 5e-3


def test_fixed_k_is_the_best_uniform_k_within_the_token_cap():
    rng = np.random.default_rng(11)
    prof = StepProfile.from_cost_model(lambda t: 1.0 + 0.03 * t, range(1, 80))
    for _ in range(40):
        conf = [rng.uniform(0.2, 1.0, int(n)) for n in rng.integers(0, 6, 9)]
        cap = int(rng.integers(9, 60))
        mask_means = [
            np.mean([c[j] for c in conf if c.size > j]) if any(c.size > j for c in conf) else 1.0
            for j in range(5)
        ]
        surv = np.cumprod(mask_means)
        best_k, best = 0, -1.0
        for k in range(6):
            kr = [min(c.size, k) for c in conf]
            tokens = 9 + sum(kr)
            if k and tokens > cap:
                break
            thr = sum(1 + surv[:r].sum() for r in kr) * prof.steps_per_s(tokens)
            if thr > best + 1e-12:
                best_k, best = k, thr
        assert fixed_k_from_means(conf, prof, max_tokens=cap) == best_k


def test_lagged_batches_refuse_bad_confidences():
    lag = LaggedConfidence()
    with pytest.raises(ValueError):
        lag.record_batch(["a", "b"], [np.array([0.5, 0.4]), np.array([np.nan])])


def test_with_one_request_the_selection_is_fixed_ks_choice():
    """What lets `choose_policy` skip the plan for one request: its survivals fall with the
    draft position, so DSpark's greedy order is positional and its best prefix is the best
    uniform K, under any profile and token cap."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        conf = [rng.uniform(0.0, 1.0, int(rng.integers(0, 6)))]
        prof = _random_profile(rng, 8)
        cap = int(rng.integers(1, 8)) if rng.random() < 0.5 else None
        want = min(fixed_k_from_means(conf, prof, max_tokens=cap), conf[0].size)
        assert select_dspark(conf, prof, max_tokens=cap) == [want]
        assert choose_policy(conf, prof, max_tokens=cap)[0] == [want]


def test_a_plan_handed_in_chooses_as_one_made_inside():
    rng = np.random.default_rng(8)
    for _ in range(200):
        b = int(rng.integers(1, 12))
        conf = rng.uniform(0.0, 1.0, (b, 5))
        prof = _random_profile(rng, 6 * b)
        cap = int(rng.integers(b, 6 * b + 1)) if rng.random() < 0.5 else None
        plan = plan_dspark(conf, prof)  # uncapped: taken only where it fits the cap
        assert choose_policy(conf, prof, max_tokens=cap, plan=plan) == choose_policy(
            conf, prof, max_tokens=cap
        )


def test_one_requests_plan_in_plain_python_equals_the_array_plan_to_the_bit():
    """`plan_dspark` at one request runs in plain Python (`_plan_one`, `StepProfile.rate_at`);
    it must give `_plan`'s drafts, expected total and throughput exactly, ties included."""
    from engine.spec.dspark import _cumprod, _padded, _plan, _plan_one

    rng = np.random.default_rng(13)
    for _ in range(400):
        k = int(rng.integers(0, 6))
        row = (
            rng.choice([0.0, 1.0, 0.5, *rng.uniform(0, 1, 3)], size=k)
            if rng.random() < 0.3
            else rng.uniform(0, 1, k)
        )
        prof = _random_profile(rng, 8)
        cap = int(rng.integers(1, 8)) if rng.random() < 0.5 else None
        for stop in ("argmax", "first_peak"):
            c, mask = _padded([row])
            want = _plan(_cumprod(c), mask, prof, cap, stop)
            got = _plan_one(row, prof, cap, stop)
            assert got.ks.tolist() == want.ks.tolist() and got.tokens == want.tokens
            assert got.expected_accepted == want.expected_accepted and got.throughput == want.throughput
        for t in (0.5, 1.0, 2.5, float(prof.tokens[-1]), 9.0):
            assert prof.rate_at(t) == float(np.interp(t, prof.tokens, prof.rates))
    with pytest.raises(ValueError):
        plan_dspark([np.array([0.5, np.nan])], prof)


def test_a_tables_memo_of_rates_is_bounded() -> None:
    """`StepProfile.rate_at` memoises what it computes, up to `MEMO_SIZE` token counts: a
    caller asking for ever new counts gets them computed, equal to `steps_per_s`, and the
    memo stops growing."""
    table = StepProfile([1, 10, 100], [50.0, 20.0, 5.0])
    for i in range(StepProfile.MEMO_SIZE + 100):
        tokens = 1.0 + i * 0.01
        assert table.rate_at(tokens) == table.steps_per_s(tokens)
    assert len(table._memo) == StepProfile.MEMO_SIZE
