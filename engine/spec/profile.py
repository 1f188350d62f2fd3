"""The profiled cost of a speculative decode step on one machine (`SpecProfile`), and where a
checkpoint keeps it (`spec_steps_file`). Measured by `engine.spec.profiling` (`sluice bench
engine --profile`, `sluice bench spec --save-profile`); read by `engine.spec.policy`. Pure:
numpy, no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from engine.spec.step_table import StepProfile, monotone_fit

MAX_DRAFTS: Final = 5
SPEC_STEPS_FILE: Final = "sluice_spec_steps.json"


def spec_steps_file(gpu: str | None = None) -> str:
    """The step profile's file name beside a checkpoint: ``SPEC_STEPS_FILE`` for the CPU, one
    per GPU model for a GPU (``sluice_spec_steps_h200.json`` for ``"NVIDIA H200"``): a step's
    cost is the machine's own, and one machine's table would misprice another's steps."""
    if gpu is None:
        return SPEC_STEPS_FILE
    name = gpu.lower().replace("nvidia", " ")
    model = re.search(r"\b[a-z]+\d{2,4}[a-z]?\b", name)  # h200, a100, l40s, mi300x
    tag = model.group(0) if model else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"sluice_spec_steps_{tag}.json"


@dataclass(frozen=True)
class SpecProfile:
    """Step times of a decode step on the serving machine, per batch size ``batch[i]``:

    * ``seconds[i][k]``: every request verifies ``k`` drafts (verification forward, sampling,
      then drafting ``drafted`` tokens per request for the next step);
    * ``draft_pass[i]``: one chained drafting pass (what drafting one token fewer saves);
    * ``plain[i]``: a step without speculation (no MTP work at all);
    * ``first_verified[i]``: a step in which one request verifies one draft and the others
      none. Once any request verifies, the step takes the verification path, whose own cost
      the uniform points spread over ``batch[i]`` drafts (on the 2-core VM at 16 requests
      5-7 ms, then 0.5-0.7 ms a draft: ``scripts/spec_partial_verify.py``); this point prices a
      selection of a few drafts (`for_batch`).

    A step drafting ``d`` tokens costs ``seconds[i][k] - (drafted - d) * draft_pass[i]``.
    Without ``draft_pass``/``plain`` (an older profile) the depth is fixed at ``drafted``
    and speculation is never turned off; without ``first_verified`` a selection is priced
    between the uniform points alone."""

    batch: tuple[int, ...]
    drafts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    drafted: int = MAX_DRAFTS
    draft_pass: tuple[float, ...] = ()
    plain: tuple[float, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    first_verified: tuple[float, ...] = ()
    # step_seconds / for_batch results: a policy asks for the same few every step (bounded by
    # the batch sizes an engine runs times the draft counts)
    _memo: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.batch or any(b <= a for a, b in zip(self.batch, self.batch[1:])) or self.batch[0] < 1:
            raise ValueError("profile batch sizes must be positive and strictly increasing")
        if list(self.drafts) != list(range(len(self.drafts))):
            raise ValueError("profile draft counts must be 0, 1, 2, ...")
        if len(self.seconds) != len(self.batch) or any(len(r) != len(self.drafts) for r in self.seconds):
            raise ValueError("profile seconds must be [len(batch)][len(drafts)]")
        if not all(math.isfinite(s) and s > 0 for row in self.seconds for s in row):
            raise ValueError("profile seconds must be finite and positive")
        for name in ("draft_pass", "plain", "first_verified"):
            v = getattr(self, name)
            if v and (len(v) != len(self.batch) or not all(math.isfinite(x) and x >= 0 for x in v)):
                raise ValueError(f"profile {name} must be empty or one finite value >= 0 per batch size")

    @property
    def adaptive(self) -> bool:
        """Whether the profile prices other drafting depths and plain decoding."""
        return bool(self.draft_pass) and bool(self.plain)

    def _at(self, batch: int, col: Sequence[float]) -> float:
        """Linear in the batch size; beyond the largest profiled batch, in proportion (the
        step is then bound by its tokens); below the smallest, clamped."""
        top = self.batch[-1]
        if batch > top:
            return col[-1] * batch / top
        return float(np.interp(batch, self.batch, col))

    def step_seconds(self, batch: int, drafts: int, drafted: int | None = None) -> float:
        """A step of ``batch`` requests verifying ``drafts`` drafts each and drafting
        ``drafted`` (default the profile's) for the next step; ``drafted = 0`` with no drafts
        verified is plain decoding."""
        key = ("s", batch, drafts, drafted)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._step_seconds(batch, drafts, drafted)
        return float(hit)

    def _step_seconds(self, batch: int, drafts: int, drafted: int | None) -> float:
        d = self.drafted if drafted is None or not self.adaptive else drafted
        if d == 0 and drafts == 0 and self.adaptive:
            return self._at(batch, self.plain)
        j = min(max(drafts, 0), len(self.drafts) - 1)
        return self._drafting(batch, self._at(batch, [row[j] for row in self.seconds]), d)

    def _drafting(self, batch: int, seconds: float, drafted: int) -> float:
        """A step measured drafting ``self.drafted`` tokens, when it drafts ``drafted``."""
        saved = (self.drafted - drafted) * self._at(batch, self.draft_pass) if self.adaptive else 0.0
        return max(seconds - saved, 1e-9)

    def uniform_seconds(self, batch: int, drafts: int) -> tuple[float, ...]:
        """Plain decoding's step, then a step verifying ``k`` of ``k`` drafted, k = 1..drafts,
        made non-decreasing as `for_batch`'s tables are (`monotone_fit`: a step that verifies
        and drafts more never runs faster; memoised: a policy prices these every step)."""
        key = ("u", batch, drafts)
        hit = self._memo.get(key)
        if hit is None:
            cells = [self.step_seconds(batch, k, k) for k in range(drafts + 1)]
            hit = self._memo[key] = tuple(monotone_fit(cells))
        return hit

    def for_batch(self, batch: int, drafted: int | None = None) -> StepProfile:
        """The step-profile table of a step of ``batch`` decoding requests that drafts
        ``drafted`` tokens each: tokens ``batch * (k + 1)`` against steps per second, and with
        ``first_verified`` the step verifying one draft at ``batch + 1`` tokens (made
        non-increasing, as a larger step never runs faster: `monotone_fit`, the least-squares
        non-decreasing fit of the step times)."""
        d = max(drafted if drafted is not None else self.drafted, 1)
        hit = self._memo.get(("t", batch, d))
        if isinstance(hit, StepProfile):
            return hit
        secs = [self.step_seconds(batch, k, d) for k in self.drafts]
        tokens = [batch * (k + 1) for k in self.drafts]
        if self.first_verified and batch > 1 and len(self.drafts) > 1:  # at 1 it is k = 1's point
            secs.insert(1, self._drafting(batch, self._at(batch, self.first_verified), d))
            tokens.insert(1, batch + 1)
        rising = monotone_fit(secs)
        table = self._memo[("t", batch, d)] = StepProfile(tokens, [1.0 / s for s in rising])
        return table

    def tables(self, batch: int, depth: int) -> tuple[StepProfile, ...]:
        """`for_batch` at every drafting depth 1..``depth`` (memoised: the drafting depth
        prices every depth each step)."""
        key = ("d", batch, depth)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tuple(self.for_batch(batch, d) for d in range(1, depth + 1))
        return hit

    def to_json(self) -> str:
        return json.dumps(
            {"batch": list(self.batch), "drafts": list(self.drafts), "seconds": [list(r) for r in self.seconds],
             "drafted": self.drafted, "draft_pass": list(self.draft_pass), "plain": list(self.plain),
             "first_verified": list(self.first_verified), "meta": self.meta},
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> SpecProfile:
        d = json.loads(text)
        return cls(
            tuple(int(b) for b in d["batch"]), tuple(int(k) for k in d["drafts"]),
            tuple(tuple(float(s) for s in row) for row in d["seconds"]), int(d.get("drafted", MAX_DRAFTS)),
            tuple(float(x) for x in d.get("draft_pass", ())), tuple(float(x) for x in d.get("plain", ())),
            dict(d.get("meta", {})), tuple(float(x) for x in d.get("first_verified", ())),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> SpecProfile:
        return cls.from_json(Path(path).read_text())


def extrapolate_layers(
    profiles: Mapping[int, SpecProfile] | Iterable[tuple[int, SpecProfile]], layers: int
) -> SpecProfile:
    """The profile of a model ``layers`` decoder layers deep, from profiles of the same widths
    measured at two or more depths (``{depth: profile}``, or ``(depth, profile)`` pairs, where
    a depth may repeat: runs of several sessions), with the same batches and draft counts.

    The principle: a step is affine in the number of decoder layers. Every decoder layer adds
    its own forward time (attention and MoE over the step's tokens); the embedding, the LM
    head, sampling, the MTP drafting passes and the host's scheduling do not grow with depth.
    So each cell is the least-squares line through its measurements, ``mean + (layers -
    mean depth) * slope``, with the slope floored at 0 (a layer never makes a step faster; a
    negative slope is measurement noise, and the best line of slope 0 is the mean). With two
    measurements that is the line through both. The drafting pass runs the MTP layer, not a
    decoder layer: its cost is the measurements' mean. Noise in the slope is multiplied by
    ``layers`` less the mean depth over the depths' spread: measure at depths far apart, and
    more than once (`fit_residuals` says how far each measurement sits from the line)."""
    pairs = sorted(profiles.items() if isinstance(profiles, Mapping) else profiles, key=lambda dp: dp[0])
    depths = np.array([d for d, _ in pairs], dtype=np.float64)
    if len(set(depths.tolist())) < 2:
        raise ValueError(f"give profiles at two or more depths, not {sorted(set(depths.tolist()))}")
    if depths[0] < 1 or layers < 1:
        raise ValueError("depths must be >= 1")
    first = pairs[0][1]
    for _, p in pairs[1:]:
        if (p.batch, p.drafts, p.drafted) != (first.batch, first.drafts, first.drafted):
            raise ValueError("the profiles must share batch sizes, draft counts and drafted depth")
        if p.adaptive != first.adaptive:
            raise ValueError("every profile must price plain decoding and the drafting pass, or none")

    def fit(cells: np.ndarray) -> np.ndarray:  # [measurements, ...] -> the cells at ``layers``
        d = (depths - depths.mean()).reshape((-1,) + (1,) * (cells.ndim - 1))
        slope = np.maximum((d * (cells - cells.mean(axis=0))).sum(axis=0) / (d * d).sum(axis=0), 0.0)
        return cells.mean(axis=0) + (layers - depths.mean()) * slope

    seconds = fit(np.array([p.seconds for _, p in pairs]))
    plain = fit(np.array([p.plain for _, p in pairs])) if first.adaptive else np.array([])
    # a decoder layer's share of the verification path's own cost grows with depth as well
    one = (
        fit(np.array([p.first_verified for _, p in pairs])) if all(p.first_verified for _, p in pairs) else ()
    )
    draft_pass = np.array([p.draft_pass for _, p in pairs]).mean(axis=0) if first.adaptive else np.array([])
    spread = sorted({int(d) for d in depths})
    meta = {
        "method": f"extrapolated to {layers} decoder layers from depths {', '.join(map(str, spread))} "
        f"({len(pairs)} measurements; engine.spec.profile.extrapolate_layers: affine in depth, least squares)",
        "measured": [{"depth": d, **p.meta} for d, p in pairs],
    }
    return SpecProfile(
        first.batch, first.drafts, tuple(tuple(float(x) for x in row) for row in seconds), first.drafted,
        tuple(float(x) for x in draft_pass), tuple(float(x) for x in plain), meta, tuple(float(x) for x in one),
    )  # fmt: skip


def fit_residuals(profiles: Iterable[tuple[int, SpecProfile]]) -> dict[str, Any]:
    """Each measurement's cells over the least-squares line's at its depth
    (`extrapolate_layers`): how well the affine principle holds, and how noisy the cells are."""
    pairs = list(profiles)
    ratios: list[float] = []
    for depth, p in pairs:
        line = extrapolate_layers(pairs, depth)
        ratios += [m / f for rm, rf in zip(p.seconds, line.seconds) for m, f in zip(rm, rf)]
        ratios += [m / f for m, f in zip(p.plain, line.plain)]
        ratios += [m / f for m, f in zip(p.first_verified, line.first_verified)]
    return {
        "measured / fitted, every cell": [round(r, 3) for r in ratios],
        "min": round(min(ratios), 3), "max": round(max(ratios), 3),
    }  # fmt: skip
