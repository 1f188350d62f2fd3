"""How an engine speculates: its settings (`SpecConfig`) and the per-step choice of how many
drafts of each request to verify (`SpecPolicy`), priced by the profiled step times
(`engine.spec.profile.SpecProfile`). Pure: numpy, no torch.

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

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from engine.spec.acceptance import DraftAcceptance
from engine.spec.costs import PLAIN, SPECULATING, StepCosts
from engine.spec.dspark import DSparkPlan, LaggedConfidence, choose_policy, plan_dspark_depths
from engine.spec.profile import MAX_DRAFTS, SpecProfile

POLICIES: Final = ("fixed", "dspark", "dspark-lagged")


@dataclass(frozen=True)
class SpecConfig:
    """``num_drafts``: drafts the MTP layer proposes per request per step; ``verify``: with
    ``fixed``, how many of them are verified (default: all; fewer measures the cost of
    drafting more than is verified, `engine.spec.profiling`); ``margin``: DSpark's selection must beat verifying a
    uniform K by this much (relative) to be used; ``profile_path``: the step profile
    (default: ``<model>/sluice_spec_steps.json`` when present); ``measured_costs``: rescale
    the profile by the engine's own step times (`SpecPolicy.observe_seconds`)."""

    policy: str = "dspark"
    num_drafts: int = MAX_DRAFTS
    verify: int | None = None
    margin: float = 0.01
    lag: int = 2
    profile_path: str | None = None
    measured_costs: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"speculative policy {self.policy!r} unknown; known: {', '.join(POLICIES)}")
        if not 1 <= self.num_drafts <= MAX_DRAFTS:
            raise ValueError(f"num_drafts must be in [1, {MAX_DRAFTS}], got {self.num_drafts}")
        if self.verify is not None and (self.policy != "fixed" or not 0 <= self.verify <= self.num_drafts):
            raise ValueError(f"verify={self.verify}: only the fixed policy takes it, within [0, num_drafts]")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.lag < 1:
            raise ValueError(f"lag must be >= 1, got {self.lag}")

    @classmethod
    def parse(cls, text: str) -> SpecConfig:
        """``"dspark"``, ``"dspark-lagged"``, ``"dspark:4"`` (4 drafts per step), ``"fixed-3"``
        (3 drafted, 3 verified) or ``"fixed-3:5"`` (5 drafted, 3 verified)."""
        name, _, drafts = text.partition(":")
        verify = None
        try:
            if name.startswith("fixed-"):
                name, k = "fixed", int(name.removeprefix("fixed-"))
                n = int(drafts) if drafts else k
                verify = k if drafts else None
            else:
                n = int(drafts) if drafts else MAX_DRAFTS
        except ValueError:
            raise ValueError(
                f"speculative setting {text!r}: use dspark, dspark-lagged or fixed-K, optionally :N drafts"
            ) from None
        return cls(policy=name, num_drafts=n, verify=verify)


@dataclass
class SpecStats:
    """Counters since the engine started (``CoreStats.extra`` reports them)."""

    steps: int = 0  # decode steps the policy planned (with drafts to verify or not)
    drafted: int = 0  # drafts available to those steps
    verified: int = 0  # drafts put into verification
    accepted: int = 0  # verified drafts that were accepted
    policies: Counter[str] = field(default_factory=Counter)  # policy chosen, per step
    depths: Counter[int] = field(default_factory=Counter)  # drafting depth set for the next step
    choose_seconds: float = 0.0  # host time spent choosing (`SpecPolicy.choose`), every step
    probes: int = 0  # steps that drafted while off (`SpecPolicy.probe_every`)
    cold_steps: int = 0  # steps that verified drafts made from restarted MTP windows

    def as_dict(self) -> dict[str, float]:
        out = {
            "spec_steps": float(self.steps),
            "spec_probes": float(self.probes),
            "spec_cold_steps": float(self.cold_steps),
            "spec_drafted_tokens": float(self.drafted),
            "spec_verified_tokens": float(self.verified),
            "spec_accepted_tokens": float(self.accepted),
            "spec_choose_seconds": self.choose_seconds,
        }
        out.update({f"spec_policy_{name.replace('-', '_')}": float(n) for name, n in self.policies.items()})
        out.update({f"spec_depth_{d}": float(n) for d, n in self.depths.items()})
        return out


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
    even with every draft accepted (``_never_pays``): there it is 0 at once. The profile's
    prices of plain and of speculating steps are each rescaled by what the engine's own steps
    of that kind took lately (``costs``, `observe_seconds`). Drafts made right after a step
    without MTP work come from restarted MTP windows (cold): they are calibrated and counted
    apart (``cold_acceptance``) and are no evidence for the depth."""

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
        self.depth = config.num_drafts  # drafts per request the next step's drafting makes
        k = config.num_drafts
        self.mode = f"dspark-{k}" if config.policy != "fixed" else f"fixed-{k}"
        # per draft position: tries, hits and the head's predictions, decayed
        self.acceptance = DraftAcceptance(k, self.PRIOR_WEIGHT)
        self._seen = 0  # requests' steps with drafts so far (the depth's first decision waits)
        # A step that drafts nothing runs no MTP pass, so the MTP layer's window misses its
        # tokens, and the next step that drafts starts every window afresh (the executor's
        # ``valid_from``): those drafts are cold, accepted far less often than the next
        # step's, though the head predicts them alike. Their outcomes are counted apart
        # (``cold_acceptance``: what calibrates cold drafts' confidences), not as evidence of what
        # drafting accepts, and a probe drafts one more step, whose warm drafts decide
        # (`_end_step`, `_choose`).
        self.cold_acceptance = DraftAcceptance(k, self.PRIOR_WEIGHT)
        self._step_depth = self.depth  # the drafting depth of the last step
        self._cold = False  # the drafts the next step verifies were made from cold windows
        self._probing = False  # a probe's drafts are on their way: the depth holds until warm
        self._since_probe = 0  # steps off since the last probe
        self._probe_every_at: dict[int, tuple[float, float]] = {}
        self._off_by_bound = False  # off because no acceptance could pay (``_never_pays``)
        self._never_pays_at: dict[int, tuple[float, float]] = {}
        # measured against priced step times, per kind of step (over as many steps as the
        # rates' memory, with as many pseudo-steps of the profile as the rates' prior)
        self.costs = StepCosts(round(1 / (1 - self.DECAY)), round(self.PRIOR_WEIGHT))
        self._relative: dict[str, float] = {}  # per option: its throughput / plain's, averaged
        # set to [] to record every step: per request (confidences, drafts verified, accepted)
        self.trace: list[list[tuple[tuple[float, ...], int, int]]] | None = None
        # set to [] to record the policy's `view` after each step with drafts (diagnostics)
        self.decisions: list[dict[str, Any]] | None = None
        # a fixed policy verifies drafts of this many requests a step at most, the first ones
        # (`engine.spec.profiling` measures the step verifying one draft with it)
        self.verifying_requests: int | None = None
        self._open: dict[str, tuple[Sequence[float], int]] = {}
        self._open_counts = self.acceptance  # where their outcomes are counted

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
        t0 = time.perf_counter()
        try:
            return self._choose(rids, confidences, max_tokens, batch)
        finally:
            self._end_step()
            self.stats.choose_seconds += time.perf_counter() - t0

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
    ) -> tuple[list[int], str]:
        n = [len(c) for c in confidences]
        if not rids:
            return [], "none"
        b = batch if batch is not None else len(rids)
        if not any(n):  # no evidence comes from this step, and none is forgotten
            return self._choose_none(len(rids), b)
        # cold drafts (`_end_step`) are calibrated and counted apart, and are no evidence of
        # what drafting accepts; a probe holds its depth for one more step, whose drafts are
        # warm
        counts, hold = (self.cold_acceptance, self._probing) if self._cold else (self.acceptance, False)
        self._probing = False
        counts.decay(self.DECAY)
        if self._cold:
            self.stats.cold_steps += 1
        else:
            self._seen += len(n) - n.count(0)  # requests with drafts this step
        raw = self._record_confidences(rids, confidences, n, counts)
        selects = self.config.policy != "fixed" and self.profile is not None  # DSpark
        # the depth is for the steps to come, whose drafts are warm
        conf = self.acceptance.calibrated(raw) if selects else raw
        plan = self._set_depth(b, conf) if self.adaptive and not hold else None
        if selects and self._cold:  # this step's own drafts are priced as cold ones
            conf, plan = self.cold_acceptance.calibrated(raw), None
        if not selects:
            cap = self.config.num_drafts if self.config.verify is None else self.config.verify
            ks = [min(cap, k) for k in n]
            if self.verifying_requests is not None:
                ks = [k if i < self.verifying_requests else 0 for i, k in enumerate(ks)]
            if max_tokens is not None:
                ks = _cap(ks, max_tokens)
            name = f"fixed-{max(ks)}" if any(ks) else "none"
        else:
            assert self.profile is not None  # (selects)
            table = self.profile.for_batch(b, self.depth)
            if self.depth != self.config.num_drafts:
                plan = None  # made for a step drafting num_drafts: another table
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
        self._bound(b)
        self._end_step(prompts_only=True)

    def _bound(self, b: int) -> None:
        """`prepare`'s depth: off at a batch where no acceptance could pay (`_never_pays`)."""
        if not self.adaptive or b < 1:
            return
        if self._never_pays(b):
            self.mode, self.depth, self._off_by_bound = "off", 0, True
        elif self._off_by_bound:  # this batch size might pay: draft again and gather evidence
            self.mode, self.depth, self._off_by_bound = self._deepest, self.config.num_drafts, False

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

    @property
    def _deepest(self) -> str:
        """The mode before evidence: DSpark's selection over every draft."""
        return f"dspark-{self.config.num_drafts}"

    def _never_pays(self, b: int) -> bool:
        """Whether plain decoding beats speculation at ``b`` requests even if every draft were
        accepted: the best uniform K (the cheapest step that verifies K drafts drafts only K)
        then emits K + 1 tokens per request per step and still runs slower. No acceptance
        rate is needed to know it, so no evidence is waited for. The profile's throughputs
        are cached per batch size; the measured scales apply to them each time."""
        assert self.profile is not None
        hit = self._never_pays_at.get(b)
        if hit is None:
            secs = self.profile.uniform_seconds(b, self.config.num_drafts)
            best = max(b * (1 + k) / secs[k] for k in range(1, len(secs)))
            hit = self._never_pays_at[b] = (b / secs[0], best)
        plain, best = hit
        return best / self.costs.scale(SPECULATING) <= plain / self.costs.scale(PLAIN)

    def _set_depth(self, b: int, conf: np.ndarray | list[np.ndarray]) -> DSparkPlan | None:
        """The next step's drafting depth: plain decoding, a uniform K, or DSpark over the
        first d drafts, whichever the profile prices fastest (``conf``: this step's
        confidences, recalibrated), on average over the last ~``MIN_EVIDENCE`` requests'
        steps. Until that many requests' steps have had drafts the depth stays
        ``num_drafts`` (their values are averaged all the same). Returns DSpark's plan over
        every draft where it made one on this step's own confidences (every request with
        ``num_drafts`` or more), which the step's selection can then take as it is."""
        assert self.profile is not None
        self._bound(b)
        if self._off_by_bound:
            return None
        drafted = bool(conf.size) if isinstance(conf, np.ndarray) else any(c.size for c in conf)
        if not drafted and self._seen < self.MIN_EVIDENCE:
            return None  # no confidences, and no decision yet to reprice
        options, plan = self._options(b, conf if drafted else None)
        # each option's throughput over plain decoding's, averaged over the last steps by
        # their requests: one step of b requests weighs b / MIN_EVIDENCE, so that a choice
        # rests on ~32 requests' confidences (one step's from 32 requests on; at one request
        # a single step's confidences are one draw, and a step sure of its drafts would
        # switch drafting on for the next step's, and an unsure one off)
        w = min(1.0, b / self.MIN_EVIDENCE)
        off = options["off"][0]
        avg = self._relative
        for m, (v, _) in options.items():
            avg[m] = v / off if m not in avg else avg[m] + w * (v / off - avg[m])
        if self._seen < self.MIN_EVIDENCE:  # too few requests' drafts yet: keep drafting all
            self._record(b, drafted)
            return plan
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
        self._probe(b)
        self._record(b, drafted)
        return plan

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
            "batch": b, "mode": self.mode, "depth": self.depth, "seen": self._seen,
            "values": {m: round(v, 4) for m, v in self._relative.items()},
            "rates": None if rates is None else [round(r, 4) for r in rates],
            "calibration": [round(c, 4) for c in self.calibration()],
            "cold_calibration": [round(c, 4) for c in self.cold_acceptance.calibration()],
            "head_means": [round(c, 4) for c in self.acceptance.head_means()],
        }  # fmt: skip

    def _options(
        self, b: int, conf: np.ndarray | list[np.ndarray] | None
    ) -> tuple[dict[str, tuple[float, int]], DSparkPlan | None]:
        """Each depth's priced throughput at ``b`` requests, with the depth it drafts: on
        this step's (recalibrated) confidences, or on the rates observed lately where the
        step has none (``conf`` None). Also DSpark's plan over every draft where this step's
        confidences make one for every request."""
        assert self.profile is not None
        rates = self.acceptance.rates() or self.acceptance.head_means()
        p, full = self.profile, self.config.num_drafts
        secs = p.uniform_seconds(b, full)
        plain, spec = self.costs.scale(PLAIN), self.costs.scale(SPECULATING)
        options = {"off": (b / (secs[0] * plain), 0)}
        if conf is None:  # nothing drafted this step: the rates observed lately
            surv, expected = 1.0, 1.0  # per request: P(first k accepted), tokens emitted
            for k in range(1, full + 1):
                surv *= rates[k - 1]
                expected += surv
                options[f"fixed-{k}"] = (b * expected / (secs[k] * spec), k)
            return options, None
        # every option priced on the same model, this step's requests' own (recalibrated)
        # confidences: the observed rates are those of the drafts verified, which a
        # selection picks, so they overstate what a uniform K would accept
        filled = _filled(conf, rates, full)
        for k, expected in enumerate(_uniform_expected(filled), start=1):
            options[f"fixed-{k}"] = (b * expected / (secs[k] * spec), k)
        plans = plan_dspark_depths(filled, [p.for_batch(b, d) for d in range(1, full + 1)])
        for d, pl in enumerate(plans, start=1):
            options[f"dspark-{d}"] = (pl.throughput / spec, d)
        full_rows = isinstance(conf, np.ndarray) and conf.shape[1] >= full
        return options, plans[-1] if full_rows else None

    def _probe(self, b: int) -> None:
        """Off: draft now and then (every `probe_every` steps), so that the rates follow the
        traffic."""
        if self.mode != "off":
            return
        self._since_probe += 1
        if self._since_probe >= self.probe_every(b):
            self.depth, self._since_probe, self._probing = self.config.num_drafts, 0, True
            self.stats.probes += 1
        else:
            self.depth = 0

    def probe_every(self, b: int) -> int:
        """Steps between probes at ``b`` requests: a probe's cost beyond three plain steps
        (its drafting step, whose drafts are cold; a step verifying them and drafting again,
        with the depth held; and a step verifying those, at most what follows it: each of
        the last two priced as verifying and drafting every draft) over ``PROBE_BUDGET`` of
        a plain step, from the profile as the measured scales correct it: on the CPU profile
        in docs/data/spec_profile_cpu.json, 659 steps at 16 requests (a probe's three steps
        there cost ~9.6 plain ones). The profile's prices are cached per batch size."""
        assert self.profile is not None
        hit = self._probe_every_at.get(b)
        if hit is None:
            p, full = self.profile, self.config.num_drafts
            hit = self._probe_every_at[b] = (
                p.step_seconds(b, 0, full) + 2 * p.step_seconds(b, full, full),
                p.step_seconds(b, 0, 0),
            )
        probe, plain = hit[0] * self.costs.scale(SPECULATING), hit[1] * self.costs.scale(PLAIN)
        return max(1, math.ceil((probe - 3 * plain) / (self.PROBE_BUDGET * plain)))

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
    product of each row). One request in plain Python (numpy's per-call cost)."""
    if conf.shape[0] == 1:
        out, surv, expected = [], 1.0, 1.0
        for c in conf[0].tolist():
            surv *= c
            expected += surv
            out.append(expected)
        return out
    return (1.0 + np.cumsum(np.cumprod(conf, axis=1).mean(axis=0))).tolist()


def _cap(ks: list[int], max_tokens: int) -> list[int]:
    """Trim drafts, the largest first, until ``sum(k + 1) <= max_tokens``."""
    ks = list(ks)
    while sum(k + 1 for k in ks) > max_tokens and any(ks):
        i = max(range(len(ks)), key=lambda j: ks[j])
        ks[i] -= 1
    return ks
