"""Synthetic step profiles, a policy's clock and a timed drive of a speculation policy,
for the policy's tests (`test_policy.py`, `test_policy_costs.py`)."""

from __future__ import annotations

import numpy as np

from engine.spec.policy import SpecPolicy
from engine.spec.profile import SpecProfile

DRAFTS = tuple(range(6))


def synthetic_profile(verify_s: float, pass_s: float, plain_s: float, batch=(1, 32)) -> SpecProfile:
    """Step seconds: plain decoding ``plain_s``; verifying k drafts while drafting 5 costs
    ``plain_s + 5 * pass_s + k * verify_s`` (per request in the batch, for b > 1)."""
    secs = tuple(tuple(b * (plain_s + 5 * pass_s + k * verify_s) for k in DRAFTS) for b in batch)
    return SpecProfile(
        batch, DRAFTS, secs, 5, tuple(b * pass_s for b in batch), tuple(b * plain_s for b in batch)
    )


def stale_profile(real: SpecProfile, spec_factor: float) -> SpecProfile:
    """``real`` as profiled when its speculating steps ran ``spec_factor`` times as long (its
    plain steps as now)."""
    return SpecProfile(
        real.batch, real.drafts, tuple(tuple(s * spec_factor for s in row) for row in real.seconds),
        real.drafted, tuple(p * spec_factor for p in real.draft_pass), real.plain,
    )  # fmt: skip


class Clock:
    """A policy's clock on which each of its choices takes ``host`` seconds (every reading
    is ``host`` later than the one before)."""

    def __init__(self, host: float) -> None:
        self.host, self.now = host, 0.0

    def __call__(self) -> float:
        self.now += self.host
        return self.now


def drive_timed(
    pol: SpecPolicy, conf: float, b: int, steps: int, real: SpecProfile | None, host: float = 0.0
) -> None:
    """``steps`` steps of ``b`` requests whose every draft has confidence and acceptance
    probability ``conf`` (seeded); with ``real``, each step's wall time is what ``real``
    says a step of its kind costs (plain; or verifying what the policy chose while drafting
    ``depth``), told to the policy as an engine does. Each choice on a step with drafts
    takes ``host`` seconds of the step (the policy's clock: `Clock`)."""
    rng = np.random.default_rng(0)
    rids = [f"r{i}" for i in range(b)]
    pol.clock = Clock(host)
    for _ in range(steps):
        drafted = pol.depth > 0
        ks, _ = pol.choose(rids, [[conf] * pol.depth] * b)
        if real is not None:
            verified, d = sum(ks), pol.depth
            secs = (
                real.plain[-1]
                if not verified and not d
                else real.for_batch(b, d).steps_per_s(b + verified) ** -1
            )
            pol.observe_seconds(float(secs) + (host if drafted else 0.0))
        for rid, k in zip(rids, ks):
            acc = 0
            while acc < k and rng.random() < conf:
                acc += 1
            pol.observe(rid, acc)
