"""How many drafts the MTP layer makes for the steps to come (`DraftingDepth`), for a DSpark
policy (`engine.spec.policy.SpecPolicy`) whose profile prices drafting
(`SpecProfile.adaptive`): plain decoding, a uniform K or DSpark's selection over the first d
drafts, whichever the profile prices fastest on average over the last requests' steps; off
at once where no acceptance could pay (`DraftingDepth._never_pays`), and while off, a probe
now and then (`DraftingDepth.probe_every`). Pure: numpy, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np

from engine.spec.acceptance import DraftAcceptance
from engine.spec.config import SpecConfig, SpecStats
from engine.spec.costs import PLAIN, SPECULATING, StepCosts
from engine.spec.dspark import DSparkPlan, plan_dspark_depths, plan_rows_depths
from engine.spec.profile import SpecProfile


class DepthSettings(Protocol):
    """What the depth reads of its policy at each use: `SpecPolicy.MIN_EVIDENCE` and
    `SpecPolicy.PROBE_BUDGET` (class constants, which a test may patch)."""

    @property
    def MIN_EVIDENCE(self) -> float: ...

    @property
    def PROBE_BUDGET(self) -> float: ...


class DraftingDepth:
    """A speculation policy's drafting depth (``depth``: drafts per request the next step's
    drafting makes) and the option it follows (``mode``: ``off``, ``fixed-K`` or
    ``dspark-d``), with its off switch and probes. ``costs`` (the measured scales of the
    profile's prices) and ``acceptance`` (the warm drafts' rates) are the policy's own, and
    so are ``settings``' ``MIN_EVIDENCE`` and ``PROBE_BUDGET``. The policy counts the
    requests' steps with drafts (``seen``) and, for a probe's cold drafts, holds the depth
    (``probing``)."""

    def __init__(
        self,
        config: SpecConfig,
        profile: SpecProfile | None,
        costs: StepCosts,
        acceptance: DraftAcceptance,
        settings: DepthSettings,
    ) -> None:
        self.config = config
        self.profile = profile
        self.costs = costs
        self.acceptance = acceptance
        self.settings = settings
        k = config.num_drafts
        self.depth = k  # drafts per request the next step's drafting makes
        self.mode = f"dspark-{k}" if config.policy != "fixed" else f"fixed-{k}"
        self.seen = 0  # requests' steps with drafts so far (the depth's first decision waits)
        self.probing = False  # a probe's drafts are on their way: the depth holds until warm
        self._since_probe = 0  # steps off since the last probe
        self._probe_every_at: dict[int, tuple[float, float]] = {}
        self._off_by_bound = False  # off because no acceptance could pay (``_never_pays``)
        self._relative: dict[str, float] = {}  # per option: its throughput / plain's, averaged
        # steps off with nothing drafted, not yet averaged into ``_relative``: their key
        # (batch, the measured scales and host time, the rates' version), the options'
        # values / plain's on them, and how many steps in a row had that key (`_flush_idle`)
        self._idle: tuple[tuple[int, float, float, float, int], dict[str, float]] | None = None
        self._idle_steps = 0

    def bound(self, b: int) -> None:
        """`SpecPolicy.prepare`'s depth: off at a batch where no acceptance could pay
        (`_never_pays`)."""
        if b < 1:
            return
        if self._never_pays(b):
            self.mode, self.depth, self._off_by_bound = "off", 0, True
        elif self._off_by_bound:  # this batch size might pay: draft again and gather evidence
            self.mode, self.depth, self._off_by_bound = self._deepest, self.config.num_drafts, False

    @property
    def _deepest(self) -> str:
        """The mode before evidence: DSpark's selection over every draft."""
        return f"dspark-{self.config.num_drafts}"

    def _never_pays(self, b: int) -> bool:
        """Whether plain decoding beats speculation at ``b`` requests even if every draft were
        accepted: the best uniform K (the cheapest step that verifies K drafts drafts only K)
        then emits K + 1 tokens per request per step and still runs slower, at the profile's
        prices as measured (`StepCosts`: the scales, and the policy's own host time in a
        speculating step). No acceptance rate is needed to know it, so no evidence is waited
        for."""
        assert self.profile is not None
        secs = self.profile.uniform_seconds(b, self.config.num_drafts)  # memoised
        costs = self.costs
        best = max(b * (1 + k) / costs.speculating(secs[k]) for k in range(1, len(secs)))
        return best <= b / (secs[0] * costs.scale(PLAIN))

    def update(
        self,
        b: int,
        conf: np.ndarray | list[np.ndarray],
        stats: SpecStats,
        record: Callable[[int, bool], None],
    ) -> list[DSparkPlan] | None:
        """The next step's drafting depth: plain decoding, a uniform K, or DSpark over the
        first d drafts, whichever the profile prices fastest (``conf``: this step's
        confidences, recalibrated), on average over the last ~``MIN_EVIDENCE`` requests'
        steps. Until that many requests' steps have had drafts the depth stays
        ``num_drafts`` (their values are averaged all the same). Returns DSpark's plans at
        every depth where it made them on this step's own confidences (``conf`` one [B, K]
        array): ``plans[d - 1]`` selects among the first ``d`` drafts, priced for a step
        drafting ``d``, which the step's selection can take as it is where it has ``d`` drafts
        a request and drafts ``d`` next (`plan_for`). A probe is counted in ``stats``;
        ``record(b, drafted)`` is told of each decision (`SpecPolicy._record`)."""
        assert self.profile is not None
        self.bound(b)
        if self._off_by_bound:
            return None
        drafted = bool(conf.size) if isinstance(conf, np.ndarray) else any(c.size for c in conf)
        if not drafted and self.seen < self.settings.MIN_EVIDENCE:
            return None  # no confidences, and no decision yet to reprice
        if not drafted and self.mode == "off":
            # off, only drafts switch it on (below): such a step changes no choice, only the
            # averages, towards values that stay the same while nothing they rest on moves
            self._idle_step(b)
            self.depth = 0
            self._probe(b, stats)
            return None
        self._flush_idle()
        options, plans = self._options(b, conf if drafted else None)
        # each option's throughput over plain decoding's, averaged over the last steps by
        # their requests: one step of b requests weighs b / MIN_EVIDENCE, so that a choice
        # rests on ~32 requests' confidences (one step's from 32 requests on; at one request
        # a single step's confidences are one draw, and a step sure of its drafts would
        # switch drafting on for the next step's, and an unsure one off)
        w = self._weight(b)
        off = options["off"][0]
        avg = self._relative
        for m, (v, _) in options.items():
            avg[m] = v / off if m not in avg else avg[m] + w * (v / off - avg[m])
        if self.seen < self.settings.MIN_EVIDENCE:  # too few requests' drafts yet: keep drafting all
            record(b, drafted)
            return plans
        best = max(options, key=avg.__getitem__)
        current = avg[self.mode] if self.mode in options else 0.0
        # off, only drafts tell what drafting accepts now: a step without them (pricing the
        # rates observed before) does not switch it back on; a probe's drafts do
        if (
            best != self.mode
            and avg[best] > current * (1.0 + self.config.margin)
            and (drafted or self.mode != "off")
        ):
            self.mode = best
        self.depth = options[self.mode][1] if self.mode in options else self.config.num_drafts
        self._probe(b, stats)
        record(b, drafted)
        return plans

    @property
    def relative(self) -> dict[str, float]:
        """Per option, its priced throughput over plain decoding's, averaged over the last
        ~``MIN_EVIDENCE`` requests' steps (what the depth follows)."""
        self._flush_idle()
        return self._relative

    def _weight(self, b: int) -> float:
        """What one step of ``b`` requests weighs in the averages."""
        return min(1.0, b / self.settings.MIN_EVIDENCE)

    def _idle_step(self, b: int) -> None:
        """A step off with nothing drafted: its options are priced on the rates observed
        lately, so their values change only with the batch, the measured scales or the rates
        (`DraftAcceptance.version`); steps in a row on the same are counted, and averaged in
        at once when that changes or the averages are read (`_flush_idle`). Off at a hundred
        requests this is most steps, and each would otherwise price every option afresh
        between two device steps."""
        costs = self.costs
        key = (b, costs.scale(PLAIN), costs.scale(SPECULATING), costs.host, self.acceptance.version)
        if self._idle is None or self._idle[0] != key:
            self._flush_idle()
            options, _ = self._options(b, None)
            off = options["off"][0]
            self._idle = (key, {m: v / off for m, (v, _) in options.items()})
        self._idle_steps += 1

    def _flush_idle(self) -> None:
        """Averages in the counted idle steps: ``n`` steps of weight ``w`` towards the same
        value ``t`` leave ``t + (1 - w)^n (avg - t)``."""
        if self._idle is None:
            return
        (b, *_), values = self._idle
        keep = (1.0 - self._weight(b)) ** self._idle_steps
        avg = self._relative
        for m, t in values.items():
            avg[m] = t if m not in avg else t + keep * (avg[m] - t)
        self._idle, self._idle_steps = None, 0

    def _options(
        self, b: int, conf: np.ndarray | list[np.ndarray] | None
    ) -> tuple[dict[str, tuple[float, int]], list[DSparkPlan] | None]:
        """Each depth's priced throughput at ``b`` requests, with the depth it drafts: on
        this step's (recalibrated) confidences, or on the rates observed lately where the
        step has none (``conf`` None). Also DSpark's plan at every depth where ``conf`` is
        one [B, K] array (`update`)."""
        assert self.profile is not None
        rates = self.acceptance.rates() or self.acceptance.head_means()
        p, full = self.profile, self.config.num_drafts
        secs = p.uniform_seconds(b, full)
        costs = self.costs
        options = {"off": (b / (secs[0] * costs.scale(PLAIN)), 0)}
        if conf is None:  # nothing drafted this step: the rates observed lately
            surv, expected = 1.0, 1.0  # per request: P(first k accepted), tokens emitted
            for k in range(1, full + 1):
                surv *= rates[k - 1]
                expected += surv
                options[f"fixed-{k}"] = (b * expected / costs.speculating(secs[k]), k)
            return options, None
        # every option priced on the same model, this step's requests' own (recalibrated)
        # confidences: the observed rates are those of the drafts verified, which a
        # selection picks, so they overstate what a uniform K would accept
        tables = p.tables(b, full)
        if isinstance(conf, np.ndarray) and conf.shape[0] == 1:  # one request: plain Python
            row = conf[0, :full].tolist()
            row += rates[len(row) : full]
            uniform, plans = _uniform_expected_row(row), plan_rows_depths([row], tables)
        else:
            filled = _filled(conf, rates, full)
            uniform, plans = _uniform_expected(filled), plan_dspark_depths(filled, tables)
        for k, expected in enumerate(uniform, start=1):
            options[f"fixed-{k}"] = (b * expected / costs.speculating(secs[k]), k)
        for d, pl in enumerate(plans, start=1):  # its step: expected tokens / throughput
            step = costs.speculating(pl.expected_accepted / pl.throughput)
            options[f"dspark-{d}"] = (pl.expected_accepted / step, d)
        return options, plans if isinstance(conf, np.ndarray) else None

    def _probe(self, b: int, stats: SpecStats) -> None:
        """Off: draft now and then (every `probe_every` steps), so that the rates follow the
        traffic."""
        if self.mode != "off":
            return
        self._since_probe += 1
        if self._since_probe >= self.probe_every(b):
            self.depth, self._since_probe, self.probing = self.config.num_drafts, 0, True
            stats.probes += 1
        else:
            self.depth = 0

    def probe_every(self, b: int) -> int:
        """Steps between probes at ``b`` requests: a probe's cost beyond three plain steps
        (its drafting step, whose drafts are cold; a step verifying them and drafting again,
        with the depth held; and a step verifying those, at most what follows it: each of
        the last two priced as verifying and drafting every draft) over ``PROBE_BUDGET`` of
        a plain step, from the profile as the measured scales correct it: on the CPU profile
        in docs/data/spec_profile_cpu.json, 659 steps at 16 requests (a probe's three steps
        there cost ~9.6 plain ones). The speculating steps are priced as the policy prices
        them, by the monotone fit of the profile's cells (`SpecProfile.for_batch`); the
        prices are cached per batch size."""
        assert self.profile is not None
        hit = self._probe_every_at.get(b)
        if hit is None:
            p, full = self.profile, self.config.num_drafts
            table = p.for_batch(b, full)
            hit = self._probe_every_at[b] = (
                1.0 / table.rate_at(b) + 2.0 / table.rate_at(b * (1 + full)),
                p.step_seconds(b, 0, 0),
            )
        probe, plain = hit[0] * self.costs.scale(SPECULATING), hit[1] * self.costs.scale(PLAIN)
        return max(1, math.ceil((probe - 3 * plain) / (self.settings.PROBE_BUDGET * plain)))


def plan_for(
    plans: list[DSparkPlan] | None, conf: np.ndarray | list[np.ndarray], depth: int, full: int
) -> DSparkPlan | None:
    """The plan of `DraftingDepth.update`'s ``plans`` that equals ``plan_dspark(conf[:, :full],
    table of a step drafting depth)``: the one at ``depth`` where ``conf`` has that many
    drafts a request (``full`` or more at ``depth = full``), else None."""
    if plans is None or not isinstance(conf, np.ndarray) or depth < 1:
        return None
    return plans[depth - 1] if min(conf.shape[1], full) == depth else None


def _filled(conf: np.ndarray | list[np.ndarray], rates: list[float], full: int) -> np.ndarray:
    """[B, full] confidences: each request's own, and the observed rates for the positions it
    has none for."""
    if isinstance(conf, np.ndarray):
        b, k = conf.shape
        return (
            conf[:, :full] if k >= full else np.hstack([conf, np.broadcast_to(rates[k:full], (b, full - k))])
        )
    return np.array([np.concatenate([c[:full], rates[c.size : full]]) for c in conf])


def _uniform_expected(conf: np.ndarray) -> list[float]:
    """Per K = 1..K_max: tokens a request emits on average verifying its first K drafts,
    ``1 + sum_{j<=K} a(r, j)``, over the rows of ``conf`` [B, K_max] (survival: the cumulative
    product of each row)."""
    if conf.shape[0] == 1:
        return _uniform_expected_row(conf[0].tolist())
    return (1.0 + np.cumsum(np.cumprod(conf, axis=1).mean(axis=0))).tolist()


def _uniform_expected_row(row: list[float]) -> list[float]:
    """`_uniform_expected` of one request's confidences, in plain Python (numpy's per-call
    cost would be most of the time)."""
    out, surv, expected = [], 1.0, 1.0
    for c in row:
        surv *= c
        expected += surv
        out.append(expected)
    return out
