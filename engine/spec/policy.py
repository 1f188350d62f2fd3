"""How an engine speculates: the per-step choice of how many drafts of each request to verify
(`SpecPolicy`), priced by the profiled step times (`engine.spec.profile.SpecProfile`), with
the drafting depth beneath it (`engine.spec.depth.DraftingDepth`); its settings and counters
are `engine.spec.config`'s (`SpecConfig`, `SpecStats`, re-exported here). Pure: numpy, no
torch.

Policies (``SpecConfig.policy``):

* ``"fixed"``: verify ``min(k, drafts)`` drafts of every request (``k`` = ``num_drafts``).
* ``"dspark"``: `engine.spec.dspark.choose_policy` on this step's confidences: DSpark's
  selection where it pays, otherwise every request verifies the same K drafts, K from the
  same profile (low concurrency: every draft).
* ``"dspark-lagged"``: the same on confidences two steps old (`LaggedConfidence`), what an
  asynchronous pipeline has when it schedules.

Without a profile, ``dspark`` cannot price a step and verifies every draft (it reports the
policy ``fixed-K``); `sluice bench engine --profile` and `sluice bench spec` write one. A
profile is one machine's (`engine.spec.profile.spec_steps_file`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from engine.spec.acceptance import DraftAcceptance
from engine.spec.config import POLICIES, SpecConfig, SpecStats
from engine.spec.costs import PLAIN, SPECULATING, StepCosts
from engine.spec.depth import DraftingDepth, plan_for
from engine.spec.dspark import DSparkPlan, choose_policy
from engine.spec.lagged import LaggedConfidence
from engine.spec.profile import SpecProfile

__all__ = ["POLICIES", "SpecConfig", "SpecPolicy", "SpecStats"]


class SpecPolicy:
    """Per step: how many drafts of each request to verify (`choose`), and how many the
    MTP layer drafts for the next step (``depth``).

    With a ``dspark`` policy and a profile that prices drafting (`SpecProfile.adaptive`),
    the depth follows the profile: each step compares the expected throughput of plain
    decoding (depth 0: no MTP work at all), of verifying a uniform K drafted tokens
    (``fixed-K``: depth K) and of DSpark's selection over the first d drafts (``dspark-d``:
    depth d), all priced on this step's confidences recalibrated against the outcomes
    observed lately (`calibration`; in a step without drafts, on the acceptance rates
    observed, per draft position, decayed by ``DECAY`` per step that has drafts); it
    switches only for a gain above ``margin``, each option's value averaged over the last
    ~``MIN_EVIDENCE`` requests' steps. Until that many requests' steps have had drafts the
    depth is ``num_drafts``, except at a batch size where plain decoding beats speculation
    even with every draft accepted (`DraftingDepth._never_pays`): there it is 0 at once.
    The profile's prices of plain and of speculating steps are each rescaled by what the
    engine's own steps of that kind took lately (``costs``, `observe_seconds`). Drafts made
    right after a step without MTP work come from restarted MTP windows (cold): they are
    calibrated and counted apart (``cold_acceptance``) and are no evidence for the depth.
    The depth, its off switch and its probes are ``drafting``'s
    (`engine.spec.depth.DraftingDepth`)."""

    # Per step with drafts to verify: observations fade over ~50 such steps. A step without
    # drafts (speculation off, a prefill's) adds no evidence and forgets none.
    DECAY: Final = 0.98
    # Requests' steps with drafts behind a decision: the depth's first waits for this many
    # (one step of 32 requests, 32 steps of one), and each option's value is averaged over
    # about as many (a step of b weighs b / MIN_EVIDENCE). Not outcomes: at one request the
    # selection verifies on some steps only, and 32 decayed outcomes of position 1 could take
    # longer to come than drafting lasted (each unsure step before them switched it off).
    MIN_EVIDENCE: Final = 32.0
    # Pseudo-observations of the prior (the confidence head's mean per position).
    PRIOR_WEIGHT: Final = 4.0
    # With speculation off, a step drafts again now and then (a probe), so the rates follow
    # the traffic. A probe costs a drafting step and at most two steps verifying and drafting
    # (its first drafts are cold: the depth holds until warm ones decide), each beyond a
    # plain step's time; probes come far enough apart that this stays within PROBE_BUDGET of
    # the plain steps' time (`probe_every`).
    PROBE_BUDGET: Final = 0.01

    def __init__(self, config: SpecConfig, profile: SpecProfile | None) -> None:
        self.config = config
        self.profile = profile
        self.lagged = LaggedConfidence(config.lag) if config.policy == "dspark-lagged" else None
        self.stats = SpecStats()
        k = config.num_drafts
        # per draft position: tries, hits and the head's predictions, decayed
        self.acceptance = DraftAcceptance(k, self.PRIOR_WEIGHT)
        # A step that drafts nothing runs no MTP pass, so the MTP layer's window misses its
        # tokens, and the next step that drafts starts every window afresh (the executor's
        # ``valid_from``): those drafts are cold, accepted far less often than the next
        # step's, though the head predicts them alike. Their outcomes are counted apart
        # (``cold_acceptance``: what calibrates cold drafts' confidences), not as evidence of what
        # drafting accepts, and a probe drafts one more step, whose warm drafts decide
        # (`_end_step`, `_choose`).
        self.cold_acceptance = DraftAcceptance(k, self.PRIOR_WEIGHT)
        # measured against priced step times, per kind of step (over as many steps as the
        # rates' memory, with as many pseudo-steps of the profile as the rates' prior)
        self.costs = StepCosts(round(1 / (1 - self.DECAY)), round(self.PRIOR_WEIGHT))
        # the drafting depth (``depth``, ``mode``), its off switch and its probes
        self.drafting = DraftingDepth(config, profile, self.costs, self.acceptance, self)
        self._step_depth = self.depth  # the drafting depth of the last step
        self._cold = False  # the drafts the next step verifies were made from cold windows
        # set to [] to record every step: per request (confidences, drafts verified, accepted)
        self.trace: list[list[tuple[tuple[float, ...], int, int]]] | None = None
        # set to [] to record the policy's `view` after each step with drafts (diagnostics)
        self.decisions: list[dict[str, Any]] | None = None
        # a fixed policy verifies drafts of this many requests a step at most, the first ones
        # (`engine.spec.profiling` measures the step verifying one draft with it)
        self.verifying_requests: int | None = None
        self._open: dict[str, tuple[Sequence[float], int]] = {}
        self._open_counts = self.acceptance  # where their outcomes are counted
        # times this policy's choices: on a step with drafts, its host time is a cost of
        # speculating that the profile (timed under a fixed policy) leaves out
        # (`StepCosts.observe_host`); a test may set a clock of its own
        self.clock: Callable[[], float] = time.perf_counter

    @property
    def depth(self) -> int:
        """Drafts per request the next step's drafting makes (``drafting.depth``)."""
        return self.drafting.depth

    @depth.setter
    def depth(self, value: int) -> None:
        self.drafting.depth = value

    @property
    def mode(self) -> str:
        """The option the depth follows (``drafting.mode``): ``off``, ``fixed-K`` or ``dspark-d``."""
        return self.drafting.mode

    @mode.setter
    def mode(self, value: str) -> None:
        self.drafting.mode = value

    @property
    def adaptive(self) -> bool:
        return self.config.policy != "fixed" and self.profile is not None and self.profile.adaptive

    def rates(self) -> np.ndarray | None:
        """P(draft j accepted | drafts before it accepted) per position (`DraftAcceptance.rates`;
        None before any outcome)."""
        rates = self.acceptance.rates()
        return None if rates is None else np.array(rates)

    def calibration(self) -> list[float]:
        """What the head's predictions are multiplied by, per position
        (`DraftAcceptance.calibration`)."""
        return self.acceptance.calibration()

    def choose(
        self,
        rids: Sequence[str],
        confidences: Sequence[Sequence[float]],
        max_tokens: int | None = None,
        batch: int | None = None,
    ) -> tuple[list[int], str]:
        """How many drafts of each request to verify this step (``confidences[i]`` has one
        entry per draft request ``i`` has; the step's tokens stay within ``max_tokens``);
        ``batch``: requests decoding this step (default ``len(rids)``). Also sets ``depth``."""
        t0 = self.clock()
        drafted = bool(rids) and any(map(len, confidences))
        try:
            return self._choose(rids, confidences, max_tokens, batch, drafted)
        finally:
            self._end_step()
            spent = self.clock() - t0
            self.stats.choose_seconds += spent
            # a step with drafts, on this machine's costs (not a profile followed as it is)
            if drafted and self.adaptive and self.config.measured_costs:
                self.costs.observe_host(spent)

    def idle(self, rows: int, batch: int | None = None) -> None:
        """``choose`` for a step of ``rows`` decoding requests of which none has a draft
        (speculation off, or a pipelined step): the step is counted, the depth set and a
        probe made now and then, with no per-request work (``batch``: default ``rows``)."""
        t0 = self.clock()
        try:
            if rows:
                self._choose_none(rows, batch if batch is not None else rows)
        finally:
            self._end_step()
            self.stats.choose_seconds += self.clock() - t0

    def _end_step(self, prompts_only: bool = False) -> None:
        """The step's depth is set: its drafts are cold where the step before drafted nothing,
        but for a step of prompts alone, whose MTP passes fill their windows."""
        self._cold = not prompts_only and self.depth > 0 and self._step_depth == 0
        self._step_depth = self.depth

    def _choose(
        self,
        rids: Sequence[str],
        confidences: Sequence[Sequence[float]],
        max_tokens: int | None,
        batch: int | None,
        drafted: bool,
    ) -> tuple[list[int], str]:
        if not rids:
            return [], "none"
        b = batch if batch is not None else len(rids)
        if not drafted:  # no evidence comes from this step, and none is forgotten
            return self._choose_none(len(rids), b)
        n = [len(c) for c in confidences]
        counts, hold = self._count_step(n)
        raw = self._record_confidences(rids, confidences, n, counts)
        if self.config.policy != "fixed" and self.profile is not None:  # DSpark
            ks, name = self._select_dspark(raw, b, max_tokens, hold)
        else:
            ks, name = self._select_fixed(n, max_tokens)
        self.stats.steps += 1
        self.stats.drafted += sum(n)
        self.stats.verified += sum(ks)
        self.stats.policies[name] += 1
        self.stats.depths[self.depth] += 1
        if self.trace is not None:
            self.trace.append([])
        self._open = dict(zip(rids, zip(confidences, ks)))
        self._open_counts = counts
        self._price_step(b, sum(ks))
        return ks, name

    def _count_step(self, n: list[int]) -> tuple[DraftAcceptance, bool]:
        """A step with drafts (``n`` per request): the counts its outcomes go to, faded by
        ``DECAY``, and whether the depth holds this step (a probe's first drafts)."""
        # cold drafts (`_end_step`) are calibrated and counted apart, and are no evidence of
        # what drafting accepts; a probe holds its depth for one more step, whose drafts are
        # warm
        counts, hold = (
            (self.cold_acceptance, self.drafting.probing) if self._cold else (self.acceptance, False)
        )
        self.drafting.probing = False
        counts.decay(self.DECAY)
        if self._cold:
            self.stats.cold_steps += 1
        else:
            self.drafting.seen += len(n) - n.count(0)  # requests with drafts this step
        return counts, hold

    def _select_dspark(
        self, raw: np.ndarray | list[np.ndarray], b: int, max_tokens: int | None, hold: bool
    ) -> tuple[list[int], str]:
        """DSpark's choice on this step's confidences ``raw``, recalibrated as warm drafts'
        (after setting the depth on them, unless it ``hold``s) or, in a cold step, as cold
        drafts'."""
        assert self.profile is not None
        # the depth is for the steps to come, whose drafts are warm
        conf = self.acceptance.calibrated(raw)
        plans = self._set_depth(b, conf) if self.adaptive and not hold else None
        if self._cold:  # this step's own drafts are priced as cold ones
            conf, plans = self.cold_acceptance.calibrated(raw), None
        table = self.profile.for_batch(b, self.depth)
        plan = plan_for(plans, conf, self.depth, self.config.num_drafts)  # made already, or None
        ks, name = choose_policy(
            conf,
            table,
            self.config.num_drafts,
            margin=self.config.margin,
            max_tokens=max_tokens,
            plan=plan,
        )
        if name == "fixed-K":
            name = f"fixed-{max(ks)}"
        return ks, name

    def _select_fixed(self, n: list[int], max_tokens: int | None) -> tuple[list[int], str]:
        """The fixed policy's choice (and DSpark's without a profile): ``verify`` (default
        every) of each request's ``n`` drafts, within ``max_tokens``."""
        cap = self.config.num_drafts if self.config.verify is None else self.config.verify
        ks = [min(cap, k) for k in n]
        if self.verifying_requests is not None:
            ks = [k if i < self.verifying_requests else 0 for i, k in enumerate(ks)]
        if max_tokens is not None:
            ks = _cap(ks, max_tokens)
        return ks, f"fixed-{max(ks)}" if any(ks) else "none"

    def _record_confidences(
        self,
        rids: Sequence[str],
        confidences: Sequence[Sequence[float]],
        n: list[int],
        counts: DraftAcceptance,
    ) -> np.ndarray | list[np.ndarray]:
        """Adds this step's confidences to the head's running means in ``counts``; returns
        those the selection uses (two steps old under ``dspark-lagged``): one [B, K] array
        when every request has K drafts (the usual case, converted in one call), else one
        array per request."""
        uniform = min(n) == max(n)
        rows: np.ndarray | list[np.ndarray]
        if uniform:
            rows = np.array(confidences, dtype=np.float64)
        else:
            rows = [np.asarray(c, dtype=np.float64) for c in confidences]
        counts.add_predictions(rows, n)
        if self.lagged is None:
            return rows
        kept = [(rid, c) for rid, c in zip(rids, rows) if c.size]
        self.lagged.record_batch([rid for rid, _ in kept], [c for _, c in kept])
        lagged = self.lagged.get_batch(rids, n)
        return np.array(lagged) if uniform else lagged

    def prepare(self, b: int) -> None:
        """The drafting depth of a step in which no request decodes yet (prompts only), for
        the ``b`` requests that will decode next: none where speculation never pays at that
        batch, so that no prompt pays for drafts nobody will verify; else as it stands. A
        prompt's MTP pass fills its window, so the drafts of such a step are never cold."""
        if self.adaptive:
            self.drafting.bound(b)
        self._end_step(prompts_only=True)

    def _choose_none(self, rows: int, b: int) -> tuple[list[int], str]:
        """``choose`` for a step in which no request has a draft (speculation off, or the
        step after a prefill): nothing to verify, so no per-request work, which at a
        hundred requests would be a noticeable share of a graphed GPU step."""
        if self.adaptive:
            self._set_depth(b, [])
        name = "off" if self.depth == 0 or self.mode == "off" else "none"
        self.stats.steps += 1
        self.stats.policies[name] += 1
        self.stats.depths[self.depth] += 1
        if self.trace is not None:
            self.trace.append([((), 0, 0)] * rows)  # what ``observe`` records for each
        self._open = {}
        self._price_step(b, 0)
        return [0] * rows, name

    def _set_depth(self, b: int, conf: np.ndarray | list[np.ndarray]) -> list[DSparkPlan] | None:
        """The next step's drafting depth (`DraftingDepth.update`, which counts a probe in
        ``stats`` and has each decision recorded by `_record`)."""
        return self.drafting.update(b, conf, self.stats, self._record)

    def _record(self, b: int, drafted: bool) -> None:
        """`decisions`: this step's `view`, where it had drafts and a record is kept."""
        if self.decisions is not None and drafted:
            self.decisions.append(self.view(b))

    def view(self, b: int) -> dict[str, Any]:
        """What the depth rests on (for diagnostics): the mode and depth, the requests' steps
        with drafts seen, each option's averaged value over plain decoding's, and per draft
        position the observed rate, the head's recalibration (for warm and for cold drafts) and
        its mean prediction."""
        rates = self.acceptance.rates()
        return {
            "batch": b, "mode": self.mode, "depth": self.depth, "seen": self.drafting.seen,
            "values": {m: round(v, 4) for m, v in self.drafting.relative.items()},
            "rates": None if rates is None else [round(r, 4) for r in rates],
            "calibration": [round(c, 4) for c in self.calibration()],
            "cold_calibration": [round(c, 4) for c in self.cold_acceptance.calibration()],
            "head_means": [round(c, 4) for c in self.acceptance.head_means()],
        }  # fmt: skip

    def probe_every(self, b: int) -> int:
        """Steps between probes at ``b`` requests, while off (`DraftingDepth.probe_every`)."""
        return self.drafting.probe_every(b)

    def observe_seconds(self, seconds: float, clean: bool = True) -> None:
        """The engine's step that this policy chose last took ``seconds`` (wall time of the
        whole step, as the profile measures one); ``clean=False``: its time was not all its
        own (a prompt's chunk, a cache load, a CUDA graph captured), so it is not counted."""
        self.costs.observe(seconds, clean)

    def _price_step(self, b: int, verified: int) -> None:
        """What the profile prices the step just chosen at (``b`` decoding requests verifying
        ``verified`` drafts in all, drafting ``depth`` each), for `observe_seconds` to
        compare with. A step that verifies but drafts nothing (the last before a switch off)
        has no cell in the profile and is not priced."""
        if not (self.adaptive and self.config.measured_costs):
            return
        assert self.profile is not None
        if verified == 0 and self.depth == 0:
            self.costs.price(PLAIN, self.profile.step_seconds(b, 0, 0))
        elif self.depth > 0:
            self.costs.price(SPECULATING, 1.0 / self.profile.for_batch(b, self.depth).rate_at(b + verified))
        else:
            self.costs.unpriced()

    def observe(self, rid: str, accepted: int) -> None:
        """The outcome of ``rid``'s verification in the step last chosen: ``accepted`` of the
        drafts it verified were (`DraftAcceptance.add_outcome`; cold drafts' in ``cold_acceptance``)."""
        entry = self._open.pop(rid, None)
        if entry is None:
            return
        conf, k = entry
        self._open_counts.add_outcome(conf, k, accepted)
        if self.trace:
            self.trace[-1].append((tuple(conf), k, accepted))

    def finished(self, rid: str) -> None:
        if self.lagged is not None:
            self.lagged.drop(rid)


def _cap(ks: list[int], max_tokens: int) -> list[int]:
    """Trim drafts, the largest first, until ``sum(k + 1) <= max_tokens``."""
    ks = list(ks)
    while sum(k + 1 for k in ks) > max_tokens and any(ks):
        i = max(range(len(ks)), key=lambda j: ks[j])
        ks[i] -= 1
    return ks
