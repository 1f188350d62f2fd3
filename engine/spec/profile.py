"""The profiled cost of a speculative decode step on one machine (`SpecProfile`), and where a
checkpoint keeps it (`spec_steps_file`). Measured by `engine.spec.profiling` (`sluice bench
engine --profile`, `sluice bench spec --save-profile`); read by `engine.spec.policy`. Pure:
numpy, no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from engine.spec.dspark import StepProfile

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
    * ``plain[i]``: a step without speculation (no MTP work at all).

    A step drafting ``d`` tokens costs ``seconds[i][k] - (drafted - d) * draft_pass[i]``.
    Without ``draft_pass``/``plain`` (an older profile) the depth is fixed at ``drafted``
    and speculation is never turned off."""

    batch: tuple[int, ...]
    drafts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    drafted: int = MAX_DRAFTS
    draft_pass: tuple[float, ...] = ()
    plain: tuple[float, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
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
        for name in ("draft_pass", "plain"):
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
        full = self._at(batch, [row[j] for row in self.seconds])
        saved = (self.drafted - d) * self._at(batch, self.draft_pass) if self.adaptive else 0.0
        return max(full - saved, 1e-9)

    def uniform_seconds(self, batch: int, drafts: int) -> tuple[float, ...]:
        """Plain decoding's step, then a step verifying ``k`` of ``k`` drafted, k = 1..drafts
        (memoised: a policy prices these every step)."""
        key = ("u", batch, drafts)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tuple(self.step_seconds(batch, k, k) for k in range(drafts + 1))
        return hit

    def for_batch(self, batch: int, drafted: int | None = None) -> StepProfile:
        """The step-profile table of a step of ``batch`` decoding requests that drafts
        ``drafted`` tokens each: tokens ``batch * (k + 1)`` against steps per second (made
        non-increasing, as a larger step never runs faster: noise is removed by a running
        maximum)."""
        d = max(drafted if drafted is not None else self.drafted, 1)
        hit = self._memo.get(("t", batch, d))
        if isinstance(hit, StepProfile):
            return hit
        secs = np.maximum.accumulate([self.step_seconds(batch, k, d) for k in self.drafts])
        tokens = [batch * (k + 1) for k in self.drafts]
        table = self._memo[("t", batch, d)] = StepProfile(tokens, [1.0 / s for s in secs])
        return table

    def to_json(self) -> str:
        return json.dumps(
            {"batch": list(self.batch), "drafts": list(self.drafts), "seconds": [list(r) for r in self.seconds],
             "drafted": self.drafted, "draft_pass": list(self.draft_pass), "plain": list(self.plain),
             "meta": self.meta},
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> SpecProfile:
        d = json.loads(text)
        return cls(
            tuple(int(b) for b in d["batch"]), tuple(int(k) for k in d["drafts"]),
            tuple(tuple(float(s) for s in row) for row in d["seconds"]), int(d.get("drafted", MAX_DRAFTS)),
            tuple(float(x) for x in d.get("draft_pass", ())), tuple(float(x) for x in d.get("plain", ())),
            dict(d.get("meta", {})),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> SpecProfile:
        return cls.from_json(Path(path).read_text())


def extrapolate_layers(profiles: Mapping[int, SpecProfile], layers: int) -> SpecProfile:
    """The profile of a model ``layers`` decoder layers deep, from two profiles of the same
    widths measured at two depths (``{depth: profile}``, same batches and draft counts).

    The principle: a step is affine in the number of decoder layers. Every decoder layer adds
    its own forward time (attention and MoE over the step's tokens); the embedding, the LM
    head, sampling, the MTP drafting passes and the host's scheduling do not grow with depth.
    So each cell is ``cell(a) + (layers - a) * slope`` with ``slope = (cell(b) - cell(a)) /
    (b - a)``, floored at 0 (a layer never makes a step faster; a negative difference is
    measurement noise). The drafting pass runs the MTP layer, not a decoder layer: its cost is
    the mean of the two measured. Noise in the slope is multiplied by ``layers - a``: measure
    at depths whose difference is well above run-to-run spread."""
    if len(profiles) != 2:
        raise ValueError(f"give profiles at exactly two depths, not {sorted(profiles)}")
    (a, pa), (b, pb) = sorted(profiles.items())
    if a < 1 or layers < 1:
        raise ValueError("depths must be >= 1")
    if (pa.batch, pa.drafts, pa.drafted) != (pb.batch, pb.drafts, pb.drafted):
        raise ValueError("the two profiles must share batch sizes, draft counts and drafted depth")
    if pa.adaptive != pb.adaptive:
        raise ValueError("both profiles must price plain decoding and the drafting pass, or neither")

    def at(x: float, y: float) -> float:
        return x + (layers - a) * max(y - x, 0.0) / (b - a)

    seconds = tuple(tuple(at(x, y) for x, y in zip(ra, rb)) for ra, rb in zip(pa.seconds, pb.seconds))
    meta = {
        "method": f"extrapolated to {layers} decoder layers from depths {a} and {b} "
        "(engine.spec.profile.extrapolate_layers: affine in depth)",
        "measured": {str(a): pa.meta, str(b): pb.meta},
    }
    return SpecProfile(
        pa.batch, pa.drafts, seconds, pa.drafted,
        tuple((x + y) / 2 for x, y in zip(pa.draft_pass, pb.draft_pass)),
        tuple(at(x, y) for x, y in zip(pa.plain, pb.plain)), meta,
    )  # fmt: skip
