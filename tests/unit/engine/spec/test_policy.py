"""`engine.spec.policy`: the speculative settings, the measured step profile and the per-step
policy (drafts verified, drafting depth)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.spec.policy import SpecConfig, SpecPolicy
from engine.spec.profile import SPEC_STEPS_FILE, SpecProfile, spec_steps_file
from tests.unit.engine.spec.policy_sims import DRAFTS, Clock, synthetic_profile


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("dspark", SpecConfig("dspark", 5)),
        ("dspark-lagged", SpecConfig("dspark-lagged", 5)),
        ("dspark:3", SpecConfig("dspark", 3)),
        ("fixed-2", SpecConfig("fixed", 2)),
        ("fixed-2:5", SpecConfig("fixed", 5, verify=2)),
        ("fixed-0:1", SpecConfig("fixed", 1, verify=0)),
    ],
)
def test_settings_parse(text: str, want: SpecConfig) -> None:
    assert SpecConfig.parse(text) == want


@pytest.mark.parametrize("text", ["medusa", "dspark:9", "fixed-0", "fixed-x", "dspark:two", "fixed-6:5"])
def test_bad_settings_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError):
        SpecConfig.parse(text)


def test_profile_prices_depth_plain_and_batch_and_round_trips() -> None:
    p = synthetic_profile(verify_s=0.002, pass_s=0.004, plain_s=0.010)
    assert p.adaptive
    assert p.step_seconds(1, 0, 0) == pytest.approx(0.010)  # plain
    assert p.step_seconds(1, 2) == pytest.approx(0.010 + 0.020 + 0.004)  # drafting 5
    assert p.step_seconds(1, 2, 1) == pytest.approx(0.010 + 0.004 + 0.004)  # drafting 1
    assert p.step_seconds(64, 0, 0) == pytest.approx(2 * p.step_seconds(32, 0, 0))  # beyond: proportional
    mid = p.step_seconds(16, 3)
    assert p.step_seconds(1, 3) < mid < p.step_seconds(32, 3)
    table = p.for_batch(8, 2)
    assert table.tokens == tuple(float(8 * (k + 1)) for k in DRAFTS)
    assert list(table.rates) == sorted(table.rates, reverse=True)
    assert SpecProfile.from_json(p.to_json()) == p
    old = SpecProfile(p.batch, p.drafts, p.seconds)  # no drafting or plain figures: depth fixed
    assert not old.adaptive and old.step_seconds(1, 2, 0) == pytest.approx(p.step_seconds(1, 2))


def test_every_price_a_policy_reads_is_monotone_when_the_cells_are_not() -> None:
    """A profile whose cells read out of order by noise (3 drafts dearer than 4, as the H100's
    and H200's do): the selection's tables and the uniform depths' prices both take the
    least-squares fit, so no option looks cheaper for verifying more."""
    p = synthetic_profile(verify_s=0.002, pass_s=0.004, plain_s=0.010)
    rows = [list(r) for r in p.seconds]
    for r, pass_s in zip(rows, p.draft_pass):  # 3 drafts read above 4, drafting 3 and 4 too
        r[3], r[4] = r[4] + 2 * pass_s, r[3]
    q = SpecProfile(p.batch, p.drafts, tuple(map(tuple, rows)), p.drafted, p.draft_pass, p.plain)
    for b in (1, 8, 32):
        raw = [q.step_seconds(b, k, k) for k in range(6)]
        assert raw[3] > raw[4]  # the cells as measured
        uniform = q.uniform_seconds(b, 5)
        assert list(uniform) == sorted(uniform) and uniform[3] == pytest.approx((raw[3] + raw[4]) / 2)
        assert uniform[:3] == tuple(raw[:3]) and uniform[5] == raw[5]  # the rest as measured
        table = q.for_batch(b)
        assert list(table.rates) == sorted(table.rates, reverse=True)


def test_the_step_verifying_one_draft_prices_a_selection_of_a_few() -> None:
    """``first_verified``: once any request verifies, the step pays the verification path's
    own cost. Without the point a selection of one draft is priced between the uniform points
    (1/16 of the way to every request verifying one), with it at the step measured."""
    from engine.spec.dspark import plan_dspark

    p = synthetic_profile(verify_s=0.002, pass_s=0.004, plain_s=0.010)
    jump = tuple(row[0] + 0.6 * (row[1] - row[0]) for row in p.seconds)  # 60 % of k = 1's step
    q = SpecProfile(p.batch, p.drafts, p.seconds, p.drafted, p.draft_pass, p.plain, first_verified=jump)
    assert SpecProfile.from_json(q.to_json()) == q and q.first_verified == jump
    table = q.for_batch(16)
    assert table.tokens[:3] == (16.0, 17.0, 32.0)
    assert table.seconds(17) == pytest.approx(q._at(16, jump))
    shallow = q.for_batch(16, 2)  # drafting 2, not 5: three passes fewer, at every point
    assert shallow.seconds(17) == pytest.approx(q._at(16, jump) - 3 * q._at(16, q.draft_pass))
    assert p.for_batch(16).tokens == tuple(float(16 * (k + 1)) for k in DRAFTS)  # without: as before
    assert q.for_batch(1).tokens == p.for_batch(1).tokens  # at one request it is k = 1's point
    # one request's likely draft among fifteen unlikely ones (0.6 more tokens on 16, +3.8 %):
    # worth verifying at 1/16 of the uniform step's extra cost (+0.4 %), not at the
    # verification path's own (+4 %)
    conf = np.full((16, 5), 0.02)
    conf[0, 0] = 0.6
    assert plan_dspark(conf, p.for_batch(16)).ks.tolist() == [1] + [0] * 15
    assert plan_dspark(conf, table).ks.tolist() == [0] * 16


def test_profile_refuses_bad_tables() -> None:
    with pytest.raises(ValueError):
        SpecProfile((4, 2), DRAFTS, ((1.0,) * 6, (1.0,) * 6))
    with pytest.raises(ValueError):
        SpecProfile((1,), (0, 2), ((1.0, 1.0),))
    with pytest.raises(ValueError):
        SpecProfile((1,), DRAFTS, ((1.0,) * 6,), plain=(1.0, 2.0))
    with pytest.raises(ValueError):
        SpecProfile((1,), DRAFTS, ((1.0,) * 6,), first_verified=(float("nan"),))


def test_fixed_verifies_k_within_the_token_budget_and_records_the_trace() -> None:
    pol = SpecPolicy(SpecConfig("fixed", 5, verify=3), None)
    pol.trace = []
    ks, name = pol.choose(["a", "b", "c"], [[0.9] * 5, [0.9] * 2, []])
    assert (ks, name) == ([3, 2, 0], "fixed-3")
    ks, _ = pol.choose(["a", "b"], [[0.9] * 5, [0.9] * 5], max_tokens=6)
    assert sum(k + 1 for k in ks) <= 6
    pol.observe("a", 1)
    assert pol.trace[-1] == [((0.9,) * 5, ks[0], 1)]
    assert pol.stats.steps == 2 and pol.stats.verified == 5 + sum(ks)


def _observe(pol: SpecPolicy, rate: float, steps: int = 40, batch: int = 32) -> None:
    """Steps in which every request verified all 5 drafts and accepted a leading run whose
    per-position acceptance is ``rate`` (deterministic: the expected counts), a calibrated
    head having predicted ``rate`` for each."""
    for _ in range(steps):
        rids = [f"r{i}" for i in range(batch)]
        pol._open = {r: ((rate,) * 5, 5) for r in rids}
        for i, r in enumerate(rids):
            # request i accepts j drafts with probability rate^j (1 - rate)
            u = (i + 0.5) / batch
            acc = 0
            while acc < 5 and u < rate ** (acc + 1):
                acc += 1
            pol.observe(r, acc)


def test_depth_turns_speculation_off_where_drafting_costs_more_than_it_brings() -> None:
    # drafting a token costs as much as a whole plain step: never worth it at 30 % acceptance
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.010, plain_s=0.010))
    assert pol.rates() is None and pol.depth == 5
    _observe(pol, 0.3)
    assert pol.rates()[0] == pytest.approx(0.3, abs=0.05)
    ks, _ = pol.choose([f"r{i}" for i in range(32)], [[0.3] * 5] * 32)
    assert (pol.mode, pol.depth) == ("off", 0)
    ks, name = pol.choose([f"r{i}" for i in range(32)], [[] for _ in range(32)])
    assert (ks, name) == ([0] * 32, "off")


def test_depth_keeps_every_draft_where_drafting_is_cheap() -> None:
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.0001, pass_s=0.0001, plain_s=0.010))
    _observe(pol, 0.8)
    pol.choose([f"r{i}" for i in range(32)], [[0.8] * 5] * 32)
    assert pol.depth == 5 and pol.mode in ("dspark-5", "fixed-5")


def test_depth_settles_on_a_uniform_k_in_between() -> None:
    # each drafted-and-verified token costs 40 % of a plain step; acceptance 0.6 per position
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.003, plain_s=0.010))
    _observe(pol, 0.6)
    for _ in range(3):
        pol.choose([f"r{i}" for i in range(32)], [[0.6] * 5] * 32)
    # uniform confidences: DSpark's selection over d drafts is the uniform d (either name)
    assert 0 < pol.depth < 5 and pol.mode in (f"fixed-{pol.depth}", f"dspark-{pol.depth}")


def _drive(pol: SpecPolicy, head: list[list[float]], truth: list[list[float]], steps: int = 120) -> None:
    """``steps`` engine steps of ``len(head)`` requests: each drafts ``pol.depth`` tokens with
    the confidences ``head[i]`` gives, and a verified draft is accepted (its earlier ones
    accepted) with probability ``truth[i][j]`` (seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    rids = [f"r{i}" for i in range(len(head))]
    for _ in range(steps):
        ks, _ = pol.choose(rids, [h[: pol.depth] for h in head])
        for rid, k, p in zip(rids, ks, truth):
            acc = 0
            while acc < k and rng.random() < p[acc]:
                acc += 1
            pol.observe(rid, acc)


def test_dspark_drafts_fewer_than_five_where_only_that_pays() -> None:
    """Half the requests have two likely drafts and three unlikely ones, half none likely;
    a drafting pass costs a fifth of a plain step. Drafting two and verifying only the first
    half's (DSpark over 2 drafts: ~120 tokens per unit time, per request) beats drafting five
    for the same selection (~88), verifying two of everyone's (~108) and plain decoding
    (100), so the depth is DSpark's at 2."""
    good, poor = [0.95, 0.95, 0.05, 0.05, 0.05], [0.05] * 5
    head = [good] * 16 + [poor] * 16
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.002, pass_s=0.002, plain_s=0.010))
    _drive(pol, head, head)
    assert (pol.mode, pol.depth) == ("dspark-2", 2)
    ks, name = pol.choose([f"r{i}" for i in range(32)], [h[:2] for h in head])
    assert name == "dspark" and ks == [2] * 16 + [0] * 16
    stats = pol.stats.as_dict()  # every planned step counts the depth it set
    assert sum(v for k, v in stats.items() if k.startswith("spec_depth_")) == stats["spec_steps"]
    # 32 requests' confidences are evidence enough: the first step already sets depth 2
    assert stats["spec_depth_2"] == stats["spec_steps"]


def test_an_over_confident_head_is_recalibrated_to_the_outcomes() -> None:
    """The head says 0.9 for every draft; 0.45 are accepted. Read as it is, its survivals
    (0.9^j) would make deep verification look worth it; scaled by the outcomes
    (`calibration` ~0.5 at position 1, the one the policy keeps trying), it settles where a
    calibrated head puts it."""
    truth = [[0.45] * 5] * 32
    honest = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.001, plain_s=0.010))
    _drive(honest, truth, truth)
    proud = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.001, plain_s=0.010))
    _drive(proud, [[0.9] * 5] * 32, truth)
    assert honest.calibration()[0] == pytest.approx(1.0, abs=0.1)
    assert proud.calibration()[0] == pytest.approx(0.5, abs=0.05)
    assert proud.depth == honest.depth < 5
    raw = SpecPolicy(SpecConfig("dspark"), proud.profile)
    raw.acceptance.calibration = lambda: [1.0] * 5  # type: ignore[method-assign]  # the head read as it is
    _drive(raw, [[0.9] * 5] * 32, truth)
    assert raw.depth == 5  # what the recalibration prevents


def test_depth_waits_for_evidence_and_probes_while_off() -> None:
    # with every draft accepted speculation would pay (K = 1: 2 tokens for 1.5 plain steps);
    # at 30 % acceptance it does not: only evidence can tell
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.004, plain_s=0.010))
    # a few bad first steps (8 requests' drafts, fewer than MIN_EVIDENCE) do not stop drafting
    _observe(pol, 0.0, steps=1, batch=8)
    pol.choose([f"r{i}" for i in range(8)], [[0.3] * 5] * 8)
    assert pol.depth == 5
    _observe(pol, 0.3)
    pol.choose([f"r{i}" for i in range(32)], [[0.3] * 5] * 32)  # 32 requests' drafts: it decides
    assert (pol.mode, pol.depth) == ("off", 0)
    depths = []
    every = pol.probe_every(32)
    for _ in range(2 * every):
        pol.choose([f"r{i}" for i in range(32)], [[] for _ in range(32)])
        depths.append(pol.depth)
    assert pol.mode == "off"
    assert depths.count(5) == 2 and depths.count(0) == len(depths) - 2  # one probe step in `every`
    assert pol.stats.probes == 2 and pol.stats.as_dict()["spec_probes"] == 2.0


def test_evidence_outlives_an_off_period_so_a_probe_does_not_restart_drafting() -> None:
    """Off on evidence, the plain steps that follow bring no outcome and forget none: when a
    probe's drafts are verified and fare as before, the policy stays off. (Decayed through
    the off period, the record fell below MIN_EVIDENCE and each probe sent the policy back to
    drafting every step until it was rebuilt.)"""
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.001, pass_s=0.004, plain_s=0.010))
    rids = [f"r{i}" for i in range(32)]
    _observe(pol, 0.3)
    pol.choose(rids, [[0.3] * 5] * 32)
    assert (pol.mode, pol.depth) == ("off", 0)
    before = pol.rates()
    for _ in range(pol.probe_every(32)):
        pol.choose(rids, [[] for _ in rids])
        if pol.depth:
            break
    assert pol.depth == 5 and pol.rates() == pytest.approx(before)  # the probe drafts; nothing forgotten
    ks, _ = pol.choose(rids, [[0.3] * 5] * 32)  # the probe's drafts: verified
    assert any(ks)
    _observe(pol, 0.3, steps=1)
    pol.choose(rids, [[] for _ in rids])
    assert (pol.mode, pol.depth) == ("off", 0)


def test_probes_cost_at_most_their_budget_of_the_plain_steps_time() -> None:
    """`probe_every`: a probe (a drafting step, whose drafts are cold, then at most two steps
    verifying and drafting every draft) costs no more than ``PROBE_BUDGET`` of the plain
    steps between probes, at every batch size, and probes come sooner where drafting is
    cheaper."""
    for verify_s, pass_s in ((0.001, 0.004), (0.004, 0.001), (0.0001, 0.0001)):
        prof = synthetic_profile(verify_s=verify_s, pass_s=pass_s, plain_s=0.010)
        pol = SpecPolicy(SpecConfig("dspark"), prof)
        for b in (1, 8, 32, 64):
            plain = prof.step_seconds(b, 0, 0)
            extra = prof.step_seconds(b, 0, 5) + 2 * prof.step_seconds(b, 5, 5) - 3 * plain
            every = pol.probe_every(b)
            assert extra <= SpecPolicy.PROBE_BUDGET * plain * every * (1 + 1e-9)  # (rounding)
            assert extra > SpecPolicy.PROBE_BUDGET * plain * (every - 1)  # and no rarer than that
    cheap = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.0001, pass_s=0.0001, plain_s=0.010))
    dear = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.004, pass_s=0.004, plain_s=0.010))
    assert cheap.probe_every(8) < dear.probe_every(8)


def test_a_probe_is_priced_by_the_fitted_cells_the_policy_prices_with() -> None:
    """A row whose step verifying 5 drafts reads faster than verifying 4 (noise): the probe's
    two verifying steps are priced at the least-squares monotone fit, as the selection prices
    them, not at the raw cell."""
    import math

    from engine.spec.step_table import monotone_fit

    cells = (0.012, 0.030, 0.040, 0.050, 0.070, 0.060)  # verifying 0-5 of 5 drafted
    prof = SpecProfile((8,), tuple(range(6)), (cells,), 5, (0.002,), (0.010,))
    pol = SpecPolicy(SpecConfig("dspark"), prof)
    plain = 0.010
    fitted = monotone_fit(cells)[5]  # 0.065: the 4- and 5-draft cells pooled
    probe = cells[0] + 2 * fitted
    assert pol.probe_every(8) == math.ceil((probe - 3 * plain) / (SpecPolicy.PROBE_BUDGET * plain))
    raw = cells[0] + 2 * cells[5]
    assert pol.probe_every(8) > math.ceil((raw - 3 * plain) / (SpecPolicy.PROBE_BUDGET * plain))


def test_drafts_the_selection_never_verifies_stop_before_any_outcome() -> None:
    """Before any outcome: 32 requests' drafts whose confidences are too low for their
    verification's cost turn drafting off at once (no outcome will ever come from them) and
    the policy probes as when off; a probe whose drafts are worth verifying resumes drafting.
    (On the H200 at 128 requests the engine once drafted every step and verified none: 5.5 ms
    steps against 3.8 plain.)"""
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.004, pass_s=0.001, plain_s=0.010))
    rids = [f"r{i}" for i in range(32)]
    ks, name = pol.choose(rids, [[0.02] * 5] * 32)
    assert (ks, name) == ([0] * 32, "none") and pol.rates() is None
    assert (pol.mode, pol.depth) == ("off", 0)
    depths = []
    for _ in range(pol.probe_every(32)):
        assert pol.choose(rids, [[] for _ in rids]) == ([0] * 32, "off")
        depths.append(pol.depth)
    # one probe in the interval (the step that turned drafting off counts as its first)
    assert depths.count(5) == 1 and depths[-2] == 5
    ks, _ = pol.choose(rids, [[0.95] * 5] * 32)  # the probe's drafts are worth verifying
    assert any(ks) and pol.mode in ("fixed-5", "dspark-5") and pol.depth == 5


def test_speculation_that_cannot_pay_at_any_acceptance_is_off_without_evidence() -> None:
    """A GPU whose eager verification costs ~10 plain graphed steps (the H200 measured 4.8 ms
    plain, 93 ms verifying 5 drafts, at batch 1): even with every draft accepted speculation
    loses, so the first step already decodes plainly, without probes; at a batch size where
    it could pay, the policy drafts again to gather evidence."""
    prof = SpecProfile(
        (1, 32), DRAFTS,
        tuple(tuple(b * (0.0048 + 0.03 + 0.012 * k) for k in DRAFTS) for b in (1, 32)),
        5, (0.006, 0.006 * 32), (0.0048, 0.0048 * 32),
    )  # fmt: skip
    pol = SpecPolicy(SpecConfig("dspark"), prof)
    assert pol.rates() is None
    ks, _ = pol.choose(["a"], [[0.9] * 5])
    assert (pol.mode, pol.depth) == ("off", 0)
    for _ in range(2 * pol.probe_every(1)):
        assert pol.choose(["a"], [[]]) == ([0], "off") and pol.depth == 0  # no probe: none could pay
    cheap = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.0001, pass_s=0.0001, plain_s=0.010))
    cheap.choose(["a"], [[0.9] * 5])
    assert cheap.depth == 5  # could pay: keeps drafting while it gathers evidence


@pytest.mark.parametrize("policy", ["dspark", "dspark-lagged"])
def test_a_step_without_drafts_records_what_verification_would_have(policy: str) -> None:
    """With speculation off no request has drafts, and ``choose`` skips its per-request work.
    What it records must still be what an observed step records: one (no confidences, 0
    verified, 0 accepted) entry per request, a counted step, the policy's name, and nothing
    left open for ``observe``; a step with drafts afterwards is traced and observed as usual."""
    slow = SpecProfile(
        (1, 32), DRAFTS,
        tuple(tuple(b * (0.0048 + 0.03 + 0.012 * k) for k in DRAFTS) for b in (1, 32)),
        5, (0.006, 0.006 * 32), (0.0048, 0.0048 * 32),
    )  # fmt: skip
    pol = SpecPolicy(SpecConfig(policy), slow)
    pol.trace = []
    rids = [f"r{i}" for i in range(3)]
    assert pol.choose(rids, [[], [], []]) == ([0, 0, 0], "off")
    for rid in rids:
        pol.observe(rid, 0)
    assert pol.trace == [[((), 0, 0)] * 3]
    assert (pol.stats.steps, pol.stats.drafted, pol.stats.verified, dict(pol.stats.policies)) == (
        1,
        0,
        0,
        {"off": 1},
    )
    assert pol.depth == 0
    fixed = SpecPolicy(SpecConfig("fixed", 2), None)
    fixed.trace = []
    fixed.choose(["a"], [[]])
    ks, name = fixed.choose(["a", "b"], [[0.9, 0.8], []])
    assert (ks, name) == ([2, 0], "fixed-2")
    fixed.observe("a", 1)
    fixed.observe("b", 0)
    assert fixed.trace == [[((), 0, 0)], [((0.9, 0.8), 2, 1), ((), 0, 0)]]
    assert dict(fixed.stats.policies) == {"none": 1, "fixed-2": 1}


def test_a_profile_file_is_named_after_the_machine_that_measured_it() -> None:
    assert spec_steps_file() == SPEC_STEPS_FILE == "sluice_spec_steps.json"
    assert spec_steps_file("NVIDIA H200") == "sluice_spec_steps_h200.json"
    assert spec_steps_file("NVIDIA A100-SXM4-80GB") == "sluice_spec_steps_a100.json"
    assert spec_steps_file("NVIDIA H100 80GB HBM3") == "sluice_spec_steps_h100.json"
    assert spec_steps_file("NVIDIA GeForce RTX 4090") == "sluice_spec_steps_geforce-rtx-4090.json"


def test_observations_count_each_position_tried_and_accepted() -> None:
    """A request that verified k drafts and accepted a of them tried positions 1..min(k, a+1)
    and had 1..min(k, a) accepted: the counted-then-folded rates equal that definition."""
    import numpy as np

    rng = np.random.default_rng(3)
    pol = SpecPolicy(SpecConfig("fixed", 5), None)
    tries, hits = np.zeros(5), np.zeros(5)
    for _ in range(6):
        tries *= SpecPolicy.DECAY
        hits *= SpecPolicy.DECAY
        rids = [f"r{i}" for i in range(16)]
        ks, _ = pol.choose(rids, [[0.5] * int(n) for n in rng.integers(0, 6, 16)])
        for rid, k in zip(rids, ks):
            acc = int(rng.integers(0, k + 1))
            pol.observe(rid, acc)
            for j in range(k):  # the definition, position by position
                tries[j] += 1
                if acc <= j:
                    break
                hits[j] += 1
    pol.rates()
    np.testing.assert_allclose(pol.acceptance.tries, tries)
    np.testing.assert_allclose(pol.acceptance.hits, hits)


def test_a_profile_extrapolated_in_depth_is_affine_in_layers() -> None:
    from engine.spec.profile import extrapolate_layers, fit_residuals

    def at_depth(layers: int, noise: float = 0.0) -> SpecProfile:
        # fixed 2 ms + 1.5 ms a layer, and 0.1 ms a layer per verified draft; drafting is the MTP's
        secs = tuple(tuple(2e-3 + layers * (1.5e-3 + k * 1e-4) + b * 1e-5 for k in DRAFTS) for b in (1, 8))
        return SpecProfile(
            (1, 8), DRAFTS, secs, 5, (4e-4 + noise, 4e-4 - noise), (layers * 1e-3, layers * 1e-3)
        )

    deep = extrapolate_layers({3: at_depth(3, 1e-5), 1: at_depth(1)}, 43)
    want = at_depth(43)
    for got_row, want_row in zip(deep.seconds, want.seconds):
        assert got_row == pytest.approx(want_row)
    assert deep.plain == pytest.approx(want.plain)
    assert deep.draft_pass == pytest.approx((4e-4 + 5e-6, 4e-4 - 5e-6))  # the two depths' mean
    assert "43 decoder layers" in deep.meta["method"]
    # a deeper step measured faster is noise: the slope is floored at 0 (the best such line
    # is the measurements' mean), never extrapolated down
    flat = extrapolate_layers({1: at_depth(3), 3: at_depth(1)}, 43)
    for got_row, a, b in zip(flat.seconds, at_depth(3).seconds, at_depth(1).seconds):
        assert got_row == pytest.approx([(x + y) / 2 for x, y in zip(a, b)])

    # more than two measurements, a depth repeated (runs of two sessions): the least-squares
    # line, which noise of opposite signs at one depth leaves where it was
    def shifted(layers: int, by: float) -> SpecProfile:
        p = at_depth(layers)
        return replace(p, seconds=tuple(tuple(x + by for x in row) for row in p.seconds))

    runs = [(1, shifted(1, 2e-4)), (1, shifted(1, -2e-4)), (2, at_depth(2)), (4, at_depth(4))]
    lsq = extrapolate_layers(runs, 43)
    for got_row, want_row in zip(lsq.seconds, want.seconds):
        assert got_row == pytest.approx(want_row)
    assert "from depths 1, 2, 4 (4 measurements" in lsq.meta["method"]
    res = fit_residuals(runs)
    cheapest = at_depth(1).seconds[0][0]  # shifted by 0.2 ms: the largest ratio
    assert res["min"] < 1.0 < res["max"] and res["max"] == pytest.approx(1 + 2e-4 / cheapest, abs=1e-3)
    assert fit_residuals([(1, at_depth(1)), (3, at_depth(3)), (4, at_depth(4))])["max"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two or more depths"):
        extrapolate_layers([(1, at_depth(1)), (1, at_depth(1))], 43)
    with pytest.raises(ValueError, match="two or more depths"):
        extrapolate_layers({1: at_depth(1)}, 43)
    with pytest.raises(ValueError, match="share"):
        extrapolate_layers({1: at_depth(1), 3: SpecProfile((1,), DRAFTS, (at_depth(3).seconds[0],))}, 43)
    # the step verifying one draft is fitted as the other cells are, where every depth has it
    one = {
        d: replace(at_depth(d), first_verified=tuple(row[0] + d * 5e-5 for row in at_depth(d).seconds))
        for d in (1, 3)
    }
    assert extrapolate_layers(one, 43).first_verified == pytest.approx(
        [row[0] + 43 * 5e-5 for row in want.seconds]
    )
    assert extrapolate_layers({1: one[1], 3: at_depth(3)}, 43).first_verified == ()


def test_at_one_request_the_depth_follows_the_confidences_of_many_steps_not_the_last() -> None:
    """One request whose drafts are sure on one step and unsure on the next (0.95, then 0.3,
    at every position; accepted as often). Verifying one draft a step pays on average (1.20x
    plain decoding: a sure step's 1.44x, an unsure step's 0.96x). Deciding on each step's
    own confidences, the policy switched drafting off after every unsure step, so the sure
    step after it had nothing to verify: it verified only on unsure steps and was off on 249
    of 400. Averaging the options' values over ~32 requests' confidences (one step of 32, or
    32 steps of one), it keeps drafting."""
    import numpy as np

    pol = SpecPolicy(
        SpecConfig("dspark"), synthetic_profile(verify_s=0.002, pass_s=0.0015, plain_s=0.010, batch=(1, 32))
    )
    rng = np.random.default_rng(0)
    for step in range(400):
        p = 0.95 if step % 2 else 0.3
        ks, _ = pol.choose(["r"], [[p] * pol.depth])
        acc = 0
        while acc < ks[0] and rng.random() < p:
            acc += 1
        pol.observe("r", acc)
    off = pol.stats.policies["off"] + pol.stats.policies["none"]
    assert pol.mode != "off" and off < 40, pol.stats.policies


def _one_request_run(pol: SpecPolicy, steps: int, seed: int = 0) -> tuple[float, float]:
    """``steps`` engine steps of one request whose drafts' confidences are drawn anew each
    step (uniform per position) and accepted as often as they say: (tokens, seconds) as the
    policy's profile prices each step (verified, drafted)."""
    import numpy as np

    assert pol.profile is not None
    rng = np.random.default_rng(seed)
    pol.clock = Clock(0.0)  # priced steps: the policy's own choice takes none of their time
    tokens = seconds = 0.0
    drafts: list[float] = []
    for _ in range(steps):
        ks, _ = pol.choose(["r"], [drafts])
        acc = 0
        while acc < ks[0] and rng.random() < drafts[acc]:
            acc += 1
        pol.observe("r", acc)
        tokens += 1 + acc
        seconds += pol.profile.step_seconds(1, ks[0], pol.depth)
        drafts = rng.random(pol.depth).tolist()  # what this step drafted for the next
    return tokens, seconds


def test_at_one_request_the_depth_decides_on_32_steps_of_drafts_not_on_outcomes() -> None:
    """One request whose drafts are sometimes sure, sometimes not (confidences drawn uniform
    per position each step, accepted as often). The depth's first decision waits for 32
    requests' drafts (at one request, 32 steps) and rests on their averaged values.

    Where drafting is cheap (a pass 10 % of a plain step), drafting one draft and verifying it
    when sure pays 1.06x plain decoding. Waiting instead for 32 outcomes of position 1 (as the
    policy did), every step whose selection verified nothing before then switched drafting
    off, and the evidence never came: plain decoding's throughput (0.997x). Where drafting is
    dear (a pass 40 %), the policy is off after its 32 steps and drafts again only to probe."""
    cheap = synthetic_profile(verify_s=0.004, pass_s=0.001, plain_s=0.010, batch=(1, 32))
    pol = SpecPolicy(SpecConfig("dspark"), cheap)
    tokens, seconds = _one_request_run(pol, 3000)
    assert pol.mode == "dspark-1"
    assert tokens / seconds >= 1.03 / cheap.step_seconds(1, 0, 0)

    dear = synthetic_profile(verify_s=0.004, pass_s=0.004, plain_s=0.010, batch=(1, 32))
    pol = SpecPolicy(SpecConfig("dspark"), dear)
    tokens, seconds = _one_request_run(pol, 3000)
    assert pol.mode == "off"
    drafting = sum(n for d, n in pol.stats.depths.items() if d)
    assert drafting <= 32 + 3000 // pol.probe_every(1) + 1, pol.stats.depths  # 32, then probes
    assert tokens / seconds >= 0.97 / dear.step_seconds(1, 0, 0)  # the 32 steps' cost, ~2 %


def test_the_decision_record_views_each_step_with_drafts() -> None:
    """``decisions = []`` records `view` after each step with drafts (what
    scripts/spec_decisions.py prints): the mode and depth the step set, the requests' drafts
    seen, the averaged values; a step without drafts records nothing."""
    pol = SpecPolicy(SpecConfig("dspark"), synthetic_profile(verify_s=0.004, pass_s=0.004, plain_s=0.010))
    pol.decisions = []
    rids = [f"r{i}" for i in range(16)]
    pol.choose(rids, [[0.3] * 5] * 16)
    pol.choose(rids, [[0.3] * 5] * 16)
    pol.choose(rids, [[] for _ in rids])
    assert [v["seen"] for v in pol.decisions] == [16, 32]
    assert pol.decisions[0]["mode"] == "dspark-5"  # 16 requests' drafts: not yet decided
    assert (pol.decisions[1]["mode"], pol.decisions[1]["depth"]) == ("off", 0)
    assert pol.decisions[1]["values"]["off"] == 1.0 and pol.decisions[1]["values"]["fixed-1"] < 1.0


class _CountingColdDrafts(SpecPolicy):
    """The policy before cold drafts were set apart: every draft's outcome is evidence, and
    the step verifying a probe's drafts decides."""

    def _end_step(self, prompts_only: bool = False) -> None:
        self._step_depth = self.depth


def _drive_windows(
    pol: SpecPolicy, head: float, warm: float, cold: float, steps: int, b: int = 32
) -> list[int]:
    """``steps`` engine steps of ``b`` requests, each drafting ``pol.depth`` tokens that the
    head gives ``head``; drafts made in a step right after one that drafted nothing come from
    cold MTP windows and are accepted at ``cold`` per position, the others at ``warm``
    (deterministic: the expected counts). Returns the depth after each step."""
    rids = [f"r{i}" for i in range(b)]
    drafts, drafts_cold, depth_before = pol.depth, False, pol.depth
    depths = []
    for _ in range(steps):
        ks, _ = pol.choose(rids, [[head] * drafts] * b)
        rate = cold if drafts_cold else warm
        for i, (rid, k) in enumerate(zip(rids, ks)):
            u, acc = (i + 0.5) / b, 0
            while acc < k and u < rate ** (acc + 1):
                acc += 1
            pol.observe(rid, acc)
        # this step drafts pol.depth tokens: from cold windows if the step before drafted none
        drafts_cold, drafts, depth_before = pol.depth > 0 and depth_before == 0, pol.depth, pol.depth
        depths.append(pol.depth)
    return depths


def test_a_probes_cold_drafts_are_no_evidence_and_the_next_steps_warm_drafts_decide() -> None:
    """A step that drafts nothing leaves the MTP windows without its tokens, so a probe's
    drafts are made from cold windows, which the trained preset accepts less often (on this
    VM an accepted length 0.61-0.83 of the next steps', the head predicting them alike;
    docs/speculative.md, "Cold drafts"). Traffic whose acceptance rises from 0.25 to 0.75
    while speculation is off: counting the probes' cold drafts (0.3) as evidence, the policy
    never sees the rise and stays off; setting them apart, it holds the depth for one more
    step and decides on that step's warm drafts, and drafting comes back."""
    prof = synthetic_profile(verify_s=0.001, pass_s=0.003, plain_s=0.010)  # pays from ~0.4 accepted
    runs = {}
    for kind in (SpecPolicy, _CountingColdDrafts):
        pol = kind(SpecConfig("dspark"), prof)
        _drive_windows(pol, head=0.7, warm=0.25, cold=0.25, steps=60)
        assert (pol.mode, pol.depth) == ("off", 0)
        every = pol.probe_every(32)
        depths = _drive_windows(pol, head=0.7, warm=0.75, cold=0.3, steps=10 * every)
        runs[kind] = (pol, depths)
    ours, depths = runs[SpecPolicy]
    assert ours.mode != "off" and depths[-1] > 0 and ours.stats.probes <= 3  # back within a few probes
    assert ours.calibration()[0] > 0.9  # the warm drafts' 0.75 over the head's 0.7, with the old evidence
    # one cold step a probe, counted for /metrics
    assert ours.stats.cold_steps == ours.stats.probes == ours.stats.as_dict()["spec_cold_steps"]
    blind, blind_depths = runs[_CountingColdDrafts]
    assert blind.mode == "off" and blind.stats.probes >= 9  # off through every probe
    assert blind.calibration()[0] < 0.5  # the cold drafts' 0.3 over 0.7
    # a probe of ours drafts on two steps in a row: the cold one, whose depth holds, and the warm one
    first = depths.index(5)
    assert depths[first + 1] == 5


def test_off_only_drafts_switch_speculation_back_on() -> None:
    """Off on evidence at 32 requests, where drafting is dear; the batch falls to one request,
    where the same acceptance pays. Steps without drafts do not switch drafting back on from
    the rates observed before (each such switch starts from cold windows, and on the VM's own
    costs a policy that did so flipped on and off, 0.96 -> 0.91 of plain decoding at 8
    requests); the next probe's drafts do."""
    dear = tuple(0.020 + 0.050 + 0.005 * k for k in DRAFTS)  # at 32 requests
    cheap = tuple(0.010 + 0.0025 + 0.0005 * k for k in DRAFTS)  # at one
    prof = SpecProfile((1, 32), DRAFTS, (cheap, dear), 5, (0.0005, 0.010), (0.010, 0.020))
    pol = SpecPolicy(SpecConfig("dspark"), prof)
    _drive_windows(pol, head=0.6, warm=0.6, cold=0.6, steps=60, b=32)
    assert (pol.mode, pol.depth) == ("off", 0)
    depths = _drive_windows(pol, head=0.6, warm=0.6, cold=0.6, steps=pol.probe_every(1) + 20, b=1)
    probe = depths.index(5)
    assert probe > 20 and set(depths[:probe]) == {0}  # nothing drafted until the probe
    assert pol.mode != "off" and depths[-1] > 0  # which switched it back on


def test_drafts_of_a_step_of_prompts_are_never_cold() -> None:
    """Drafts made right after a step that drafted nothing are cold, except a step of
    prompts alone: each prompt's MTP pass fills its window. Here the batch of 32, where no
    acceptance pays, sets the depth to 0 for a step of prompts; the next step of prompts is
    for one request, where drafting might pay: its drafts are warm evidence."""
    dear = tuple(0.020 + 0.100 + 0.050 * k for k in DRAFTS)  # at 32 requests: never pays
    cheap = tuple(0.010 + 0.0025 + 0.0005 * k for k in DRAFTS)  # at one
    pol = SpecPolicy(
        SpecConfig("dspark"), SpecProfile((1, 32), DRAFTS, (cheap, dear), 5, (0.0005, 0.020), (0.010, 0.020))
    )
    pol.prepare(32)
    assert pol.depth == 0
    pol.prepare(1)
    assert pol.depth == 5
    pol.choose(["r0"], [[0.6] * 5])
    assert pol.stats.cold_steps == 0 and pol.view(1)["seen"] == 1


def test_one_requests_options_are_priced_as_the_array_path_prices_them() -> None:
    """At one request the drafting depth prices its options in plain Python (numpy's per-call
    cost was most of a one-request choice): the same values, to the bit, as the array path's
    (`_filled`, `_uniform_expected`, `plan_dspark_depths`), with fewer drafts than the depth
    filled by the observed rates, and the memoised tables and rates equal to fresh ones."""
    from engine.spec import depth as depth_mod
    from engine.spec.dspark import plan_dspark_depths

    prof = synthetic_profile(verify_s=0.002, pass_s=0.0015, plain_s=0.010, batch=(1, 32))
    pol = SpecPolicy(SpecConfig("dspark"), prof)
    rng = np.random.default_rng(3)
    for _ in range(40):  # outcomes, so that the rates differ from the head's means
        ks, _ = pol.choose(["r"], [rng.uniform(0.2, 1.0, pol.depth or DRAFTS[-1]).tolist()])
        pol.observe("r", int(rng.integers(0, ks[0] + 1)))
    rates = pol.acceptance.rates()
    assert rates is not None
    costs, full = pol.costs, pol.config.num_drafts
    secs = prof.uniform_seconds(1, full)
    for k in (1, 3, 5):
        conf = rng.uniform(0.0, 1.0, size=(1, k))
        got, got_plans = pol.drafting._options(1, conf)
        filled = depth_mod._filled(conf, rates, full)
        want_plans = plan_dspark_depths(filled, [prof.for_batch(1, d) for d in range(1, full + 1)])
        assert got_plans is not None
        for g, w in zip(got_plans, want_plans, strict=True):
            assert (g.ks.tolist(), g.expected_accepted, g.tokens, g.throughput) == (
                w.ks.tolist(), w.expected_accepted, w.tokens, w.throughput,
            )  # fmt: skip
        for j, e in enumerate(depth_mod._uniform_expected(filled), start=1):
            assert got[f"fixed-{j}"] == (e / costs.speculating(secs[j]), j)
    assert prof.tables(1, full) == tuple(prof.for_batch(1, d) for d in range(1, full + 1))
    table = prof.for_batch(32, 3)
    for tokens in (1.0, 33.0, 40.5, 96.0, 500.0):
        assert table.rate_at(tokens) == table.rate_at(tokens) == table.steps_per_s(tokens)
