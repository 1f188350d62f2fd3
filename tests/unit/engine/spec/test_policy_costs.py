"""`engine.spec.policy` and `engine.spec.costs`: what the policy's steps cost against its
profile (the measured scales, the host time of its own choice) and what its choice costs
the host (steps off averaged in at once, plans made once a step)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from engine.spec.costs import PLAIN, SPECULATING, StepCosts
from engine.spec.depth import DraftingDepth, plan_for
from engine.spec.policy import SpecConfig, SpecPolicy
from engine.spec.profile import SpecProfile
from tests.unit.engine.spec.policy_sims import DRAFTS, Clock, drive_timed, stale_profile, synthetic_profile


def test_a_stale_profile_is_rescaled_by_the_measured_steps_and_chooses_as_the_true_one(monkeypatch) -> None:
    """The profile was measured when speculating steps ran 1.5x as long as they do now (a
    lease whose host was slower; plain steps as now). By it, plain decoding beats every
    option at 32 requests and 0.7 acceptance; by today's costs, speculating pays (~1.37x).
    Told each step's wall time, the policy rescales the speculating prices by the measured
    2/3 (plain by 1) and drafts as deep as a policy on the true profile does; not told (or
    with measured costs off), it stays off."""
    monkeypatch.setattr(SpecPolicy, "PROBE_BUDGET", 0.1)  # probes every few dozen steps
    real = synthetic_profile(verify_s=0.002, pass_s=0.001, plain_s=0.010, batch=(32,))
    stale = stale_profile(real, 1.5)
    truth = SpecPolicy(SpecConfig("dspark"), real)
    drive_timed(truth, 0.7, 32, 300, real)
    assert truth.mode != "off" and truth.depth > 0
    assert truth.costs.scale(PLAIN) == pytest.approx(1.0) and truth.costs.scale(SPECULATING) == pytest.approx(
        1.0
    )
    blind = SpecPolicy(SpecConfig("dspark"), stale)
    drive_timed(blind, 0.7, 32, 300, None)
    assert blind.mode == "off"
    off = SpecPolicy(SpecConfig("dspark", measured_costs=False), stale)
    drive_timed(off, 0.7, 32, 300, real)
    assert off.mode == "off" and off.costs.steps == [0, 0]
    timed = SpecPolicy(SpecConfig("dspark"), stale)
    drive_timed(timed, 0.7, 32, 300, real)
    assert timed.costs.scale(SPECULATING) == pytest.approx(1 / 1.5, rel=1e-6)
    assert timed.costs.scale(PLAIN) == pytest.approx(1.0)
    # the same depth; with every request's drafts alike, DSpark's selection over 2 and verifying
    # 2 of each are one option within the switching margin, and either may be the one held
    assert timed.depth == truth.depth == 2 and {timed.mode, truth.mode} <= {"fixed-2", "dspark-2"}


def test_the_policys_own_host_time_is_priced_on_speculating_steps_only() -> None:
    """Speculating pays ~1.37x at 32 requests and 0.7 acceptance by the profile (the stale
    test's case), whose steps were timed under a fixed policy. When DSpark's own choice
    takes host time in each step with drafts, that time is a cost of speculating alone:
    measured (`StepCosts.host`), it is added to every speculating option and left out of the
    speculating scale, so the scales stay the profile's (1.0) and plain decoding's is not
    raised with it. A choice as dear as 40 % of a step turns speculation off; a cheap one
    (a millisecond on steps of half a second) changes nothing."""
    real = synthetic_profile(verify_s=0.002, pass_s=0.001, plain_s=0.010, batch=(32,))
    cheap = SpecPolicy(SpecConfig("dspark"), real)
    drive_timed(cheap, 0.7, 32, 300, real, host=0.001)
    assert cheap.mode != "off" and cheap.depth == 2
    assert cheap.costs.host == pytest.approx(0.001)
    dear = SpecPolicy(SpecConfig("dspark"), real)
    drive_timed(dear, 0.7, 32, 300, real, host=0.25)
    assert dear.mode == "off" and dear.costs.host == pytest.approx(0.25)
    assert dear.costs.scale(SPECULATING) == pytest.approx(1.0) and dear.costs.scale(PLAIN) == pytest.approx(
        1.0
    )
    assert dear.costs.steps[SPECULATING] > 0  # it did time speculating steps before going off


def test_step_costs_take_a_median_with_the_profile_as_a_prior() -> None:
    """Four pseudo-steps at the pooled scale (itself with four at 1.0): a few steps move
    nothing, more move the scale to what they show, one slow step among many moves nothing;
    a kind with no steps of its own follows the pooled scale (the machine's speed), one with
    its own steps is apart; a step not clean, or not priced, is not counted."""
    costs = StepCosts(window=50, prior=4)

    def steps(kind: int, n: int, priced: float, took: float) -> None:
        for _ in range(n):
            costs.price(kind, priced)
            costs.observe(took)

    steps(SPECULATING, 3, 0.010, 0.007)
    assert costs.scale(SPECULATING) == 1.0 and costs.steps == [0, 3]
    steps(SPECULATING, 7, 0.010, 0.007)
    assert costs.scale(SPECULATING) == pytest.approx(0.7)
    assert costs.scale(PLAIN) == pytest.approx(0.7)  # no plain step yet: the machine's speed
    steps(SPECULATING, 1, 0.010, 0.5)  # a collector pause
    assert costs.scale(SPECULATING) == pytest.approx(0.7)
    steps(PLAIN, 20, 0.010, 0.012)
    assert costs.scale(PLAIN) == pytest.approx(1.2) and costs.scale(SPECULATING) == pytest.approx(0.7)
    costs.price(PLAIN, 0.010)
    costs.observe(0.1, clean=False)  # a prompt's chunk ran in it
    costs.unpriced()
    costs.observe(0.1)
    costs.observe(0.1)  # nothing priced since the last
    assert costs.steps == [20, 11] and costs.scale(PLAIN) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="window"):
        StepCosts(window=0, prior=4)


@pytest.mark.parametrize("window,prior", [(1, 0), (5, 0), (7, 4), (50, 4), (3, 9)])
def test_step_costs_scales_are_the_medians_of_the_windows_with_their_priors(window: int, prior: int) -> None:
    """The scales kept from sorted windows equal the medians the definition states, taken
    afresh with ``statistics.median`` after every step: random kinds and ratios (ties
    included), windows that evict, priors from none to more than the window. A kind with no
    step and no prior keeps its scale."""
    rng = np.random.default_rng(window * 10 + prior)
    costs = StepCosts(window=window, prior=prior)
    windows: tuple[list[float], list[float]] = ([], [])
    want = [1.0, 1.0]
    for _ in range(300):
        kind = int(rng.integers(0, 2))
        took = float(rng.choice([0.5, 1.0, 1.5])) if rng.random() < 0.3 else float(rng.uniform(0.2, 3.0))
        costs.price(kind, 0.01)
        costs.observe(took * 0.01)
        windows[kind].append((took * 0.01) / 0.01)
        del windows[kind][:-window]
        pooled = statistics.median([*windows[0], *windows[1], *([1.0] * prior)])
        want = [
            statistics.median([*w, *([pooled] * prior)]) if w or prior else old
            for w, old in zip(windows, want)
        ]
        assert [costs.scale(PLAIN), costs.scale(SPECULATING)] == want


class _StepwiseIdle(DraftingDepth):
    """The depth averaging each step off into the options' values as it comes (what
    `DraftingDepth` did before it counted such steps and averaged them in at once)."""

    def _idle_step(self, b: int) -> None:
        super()._idle_step(b)
        self._flush_idle()


def test_steps_off_averaged_in_at_once_decide_as_one_by_one() -> None:
    """Off, a step without drafts changes no choice, only the options' averages; they are
    counted and averaged in when the batch, the measured scales or the rates change. Against
    a policy averaging each such step as it comes, on the same steps (off at 32 requests,
    then at one request where drafting pays, then back at 32, each step timed by a profile
    the policy's is stale against, so the scales move while off): the same depth and mode
    every step, the same probes, and averages equal to rounding."""
    dear = tuple(0.020 + 0.050 + 0.005 * k for k in DRAFTS)  # at 32 requests
    cheap = tuple(0.010 + 0.0025 + 0.0005 * k for k in DRAFTS)  # at one
    real = SpecProfile((1, 32), DRAFTS, (cheap, dear), 5, (0.0005, 0.010), (0.010, 0.020))
    rids = [f"r{i}" for i in range(32)]
    runs = []
    for stepwise in (False, True):
        pol = SpecPolicy(SpecConfig("dspark"), stale_profile(real, 0.8))
        pol.clock = Clock(0.0)  # the same (no) host time in both
        if stepwise:
            pol.drafting = _StepwiseIdle(pol.config, pol.profile, pol.costs, pol.acceptance, pol)
        rng = np.random.default_rng(0)
        seen = []
        for b, conf, steps in ((32, 0.5, 400), (1, 0.8, 300), (32, 0.5, 400)):
            for _ in range(steps):
                ks, _ = pol.choose(rids[:b], [[conf] * pol.depth] * b)
                verified, d = sum(ks), pol.depth
                secs = real.plain[-1] if b == 32 else real.plain[0]
                if verified or d:
                    secs = real.for_batch(b, max(d, 1)).steps_per_s(b + verified) ** -1
                pol.observe_seconds(float(secs))
                for rid, k in zip(rids, ks):
                    acc = 0
                    while acc < k and rng.random() < conf:
                        acc += 1
                    pol.observe(rid, acc)
                seen.append((pol.mode, pol.depth))
        runs.append((pol, seen))
    (fast, fast_seen), (ref, ref_seen) = runs
    assert fast_seen == ref_seen
    assert fast.stats.policies["off"] > 200 and fast.stats.probes >= 2  # the off path ran, and probed
    assert {m for m, _ in fast_seen} - {"off"}  # and speculation was on in between
    assert fast.drafting.relative == pytest.approx(ref.drafting.relative, rel=1e-12)


def test_the_selection_takes_the_depths_plan_only_where_it_is_the_same_plan(monkeypatch) -> None:
    """The depth's decision plans DSpark at every depth; the step's selection takes the plan
    at the depth it drafts next where the step has that many drafts a request (`plan_for`),
    and plans afresh otherwise. Against a policy that always plans afresh, on the same random
    steps (1 to 32 requests, 1 to 5 drafts each, depths moving): the same drafts verified
    every step, and plans taken on some of them."""
    import engine.spec.policy as policy_module

    prof = synthetic_profile(verify_s=0.0004, pass_s=0.0008, plain_s=0.010)
    taken = []

    def counting(plans, conf, depth, full):
        plan = plan_for(plans, conf, depth, full)
        taken.append(plan is not None)
        return plan

    runs = []
    for reuse in (True, False):
        monkeypatch.setattr(policy_module, "plan_for", counting if reuse else lambda *a: None)
        pol = SpecPolicy(SpecConfig("dspark"), prof)
        pol.clock = Clock(0.0)  # the same (no) host time in both
        rng = np.random.default_rng(3)
        chosen = []
        for _ in range(300):
            b = int(rng.choice([1, 4, 32]))
            width = pol.depth or int(rng.integers(1, 6))
            conf = rng.uniform(0.2, 1.0, size=(b, width)).round(2).tolist()
            ks, name = pol.choose([f"r{i}" for i in range(b)], conf)
            chosen.append((tuple(ks), name, pol.depth))
            for i, k in enumerate(ks):
                pol.observe(f"r{i}", int(rng.integers(0, k + 1)))
        runs.append(chosen)
    assert runs[0] == runs[1]
    assert 50 < sum(taken) < len(taken)  # taken on many steps, not on all
    assert len({d for _, _, d in runs[0]}) > 1  # the depth moved


def test_a_profile_followed_as_it_is_takes_no_host_time() -> None:
    """With measured costs off (another machine's prices), the policy's own choice is not
    timed into them: a choice as dear as the one that turns speculation off above changes
    nothing."""
    real = synthetic_profile(verify_s=0.002, pass_s=0.001, plain_s=0.010, batch=(32,))
    pol = SpecPolicy(SpecConfig("dspark", measured_costs=False), real)
    drive_timed(pol, 0.7, 32, 300, real, host=0.25)
    assert pol.costs.host == 0.0 and pol.mode != "off" and pol.depth == 2
