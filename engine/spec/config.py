"""How an engine speculates: its settings (`SpecConfig`: the policy, ``POLICIES``, and its
drafts, margin and profile) and the counters its policy keeps (`SpecStats`). The policies
themselves are `engine.spec.policy`'s. Pure: no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from engine.spec.profile import MAX_DRAFTS

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
