"""How an engine speculates: its settings (`SpecConfig`), the profiled step time of a
verification step (`SpecProfile`), and the per-step choice of how many drafts of each
request to verify (`SpecPolicy`). Pure: numpy, no torch.

Policies (``SpecConfig.policy``):

* ``"fixed"``: verify ``min(k, drafts)`` drafts of every request (``k`` = ``num_drafts``).
* ``"dspark"``: `engine.spec.dspark.choose_policy` on this step's confidences: DSpark's
  selection where it pays, otherwise every request verifies the same K drafts, K from the
  same profile (low concurrency: every draft).
* ``"dspark-lagged"``: the same on confidences two steps old (`LaggedConfidence`), what an
  asynchronous pipeline has when it schedules.

Without a profile, ``dspark`` cannot price a step and verifies every draft (it reports the
policy ``fixed-K``); `sluice bench engine --profile` and `sluice bench spec` write one.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from engine.spec.dspark import LaggedConfidence, StepProfile, choose_policy

SPEC_STEPS_FILE: Final = "sluice_spec_steps.json"
POLICIES: Final = ("fixed", "dspark", "dspark-lagged")
MAX_DRAFTS: Final = 5


@dataclass(frozen=True)
class SpecConfig:
    """``num_drafts``: drafts the MTP layer proposes per request per step; ``verify``: with
    ``fixed``, how many of them are verified (default: all; fewer measures the cost of
    drafting more than is verified, `engine.spec.profiling`); ``margin``: DSpark's selection must beat verifying a
    uniform K by this much (relative) to be used; ``profile_path``: the step profile
    (default: ``<model>/sluice_spec_steps.json`` when present)."""

    policy: str = "dspark"
    num_drafts: int = MAX_DRAFTS
    verify: int | None = None
    margin: float = 0.01
    lag: int = 2
    profile_path: str | None = None

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


@dataclass(frozen=True)
class SpecProfile:
    """Seconds of one decode step (verification forward, sampling and drafting) with
    ``batch[i]`` requests each verifying ``drafts[j]`` drafts: ``seconds[i][j]``, measured on
    the serving machine with the drafter proposing ``drafted`` tokens per request."""

    batch: tuple[int, ...]
    drafts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    drafted: int = MAX_DRAFTS
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.batch or any(b <= a for a, b in zip(self.batch, self.batch[1:])) or self.batch[0] < 1:
            raise ValueError("profile batch sizes must be positive and strictly increasing")
        if list(self.drafts) != list(range(len(self.drafts))):
            raise ValueError("profile draft counts must be 0, 1, 2, ...")
        if len(self.seconds) != len(self.batch) or any(len(r) != len(self.drafts) for r in self.seconds):
            raise ValueError("profile seconds must be [len(batch)][len(drafts)]")
        if not all(math.isfinite(s) and s > 0 for row in self.seconds for s in row):
            raise ValueError("profile seconds must be finite and positive")

    def step_seconds(self, batch: int, drafts: int) -> float:
        """Interpolated linearly in the batch size; beyond the largest profiled batch, scaled
        in proportion (the step is then bound by its tokens); draft counts are clamped."""
        j = min(max(drafts, 0), len(self.drafts) - 1)
        col = [row[j] for row in self.seconds]
        top = self.batch[-1]
        if batch > top:
            return col[-1] * batch / top
        return float(np.interp(batch, self.batch, col))

    def for_batch(self, batch: int) -> StepProfile:
        """The step-profile table of a step of ``batch`` decoding requests: tokens
        ``batch * (k + 1)`` against steps per second (made non-increasing, as a larger
        step never runs faster: measurement noise is removed by a running maximum)."""
        secs = np.maximum.accumulate([self.step_seconds(batch, k) for k in self.drafts])
        tokens = [batch * (k + 1) for k in self.drafts]
        return StepProfile(tokens, [1.0 / s for s in secs])

    def to_json(self) -> str:
        return json.dumps(
            {"batch": list(self.batch), "drafts": list(self.drafts), "seconds": [list(r) for r in self.seconds],
             "drafted": self.drafted, "meta": self.meta},
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> SpecProfile:
        d = json.loads(text)
        return cls(
            tuple(int(b) for b in d["batch"]), tuple(int(k) for k in d["drafts"]),
            tuple(tuple(float(s) for s in row) for row in d["seconds"]), int(d.get("drafted", MAX_DRAFTS)),
            dict(d.get("meta", {})),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> SpecProfile:
        return cls.from_json(Path(path).read_text())


@dataclass
class SpecStats:
    """Counters since the engine started (``CoreStats.extra`` reports them)."""

    steps: int = 0  # decode steps in which at least one request had drafts
    drafted: int = 0  # drafts available to those steps
    verified: int = 0  # drafts put into verification
    accepted: int = 0  # verified drafts that were accepted
    policies: Counter[str] = field(default_factory=Counter)  # policy chosen, per step

    def as_dict(self) -> dict[str, float]:
        out = {
            "spec_steps": float(self.steps),
            "spec_drafted_tokens": float(self.drafted),
            "spec_verified_tokens": float(self.verified),
            "spec_accepted_tokens": float(self.accepted),
        }
        out.update({f"spec_policy_{name.replace('-', '_')}": float(n) for name, n in self.policies.items()})
        return out


class SpecPolicy:
    def __init__(self, config: SpecConfig, profile: SpecProfile | None) -> None:
        self.config = config
        self.profile = profile
        self.lagged = LaggedConfidence(config.lag) if config.policy == "dspark-lagged" else None
        self.stats = SpecStats()
        # set to [] to record every step: per request (confidences, drafts verified, accepted)
        self.trace: list[list[tuple[tuple[float, ...], int, int]]] | None = None
        self._open: dict[str, tuple[tuple[float, ...], int]] = {}

    def choose(
        self, rids: Sequence[str], confidences: Sequence[Sequence[float]], max_tokens: int | None = None
    ) -> tuple[list[int], str]:
        """How many drafts of each request to verify this step (``confidences[i]`` has one
        entry per draft request ``i`` has; the step's tokens stay within ``max_tokens``)."""
        n = [len(c) for c in confidences]
        if not rids:
            return [], "none"
        if self.lagged is not None:
            for rid, c in zip(rids, confidences):
                self.lagged.record(rid, np.asarray(c, dtype=np.float64))
        if self.config.policy == "fixed" or self.profile is None:
            cap = self.config.num_drafts if self.config.verify is None else self.config.verify
            ks = [min(cap, k) for k in n]
            if max_tokens is not None:
                ks = _cap(ks, max_tokens)
            name = f"fixed-{max(ks)}" if any(ks) else "none"
        else:
            conf = (
                [np.asarray(c, dtype=np.float64) for c in confidences]
                if self.lagged is None
                else self.lagged.get_batch(rids, n)
            )
            ks, name = choose_policy(
                conf, self.profile.for_batch(len(rids)), self.config.num_drafts, margin=self.config.margin,
                max_tokens=max_tokens,
            )  # fmt: skip
            if name == "fixed-K":
                name = f"fixed-{max(ks)}"
        self.stats.steps += 1
        self.stats.drafted += sum(n)
        self.stats.verified += sum(ks)
        self.stats.policies[name] += 1
        if self.trace is not None:
            self.trace.append([])
            self._open = {rid: (tuple(float(x) for x in c), k) for rid, c, k in zip(rids, confidences, ks)}
        return ks, name

    def observe(self, rid: str, accepted: int) -> None:
        """The outcome of ``rid``'s verification in the step last chosen (with ``trace``)."""
        entry = self._open.pop(rid, None) if self.trace is not None else None
        if entry is not None and self.trace:
            self.trace[-1].append((entry[0], entry[1], accepted))

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
