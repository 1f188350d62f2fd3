"""What this engine's steps cost now against what its step profile says (`StepCosts`). Pure
Python, no torch.

A profile is measured once, on one lease of a machine, in one hour of it; the policy then
prices every option with it. Where the machine runs its steps faster or slower than when it
was profiled, and not alike for every kind of step, the profile misprices one option against
another: on one H100 the profile of one lease priced a batch-1 step verifying 5 drafts at
7.52 ms, and the same checkpoint and code ran such steps at 6.49 ms in a later lease (its
plain steps at the profile's 2.72 ms), which is the difference between speculating and not
at one request. So the policy times the steps it chose and rescales the profile by what it
measured, per kind of step: plain (nothing verified, nothing drafted) and speculating
(anything else), the two sides of the choice it makes.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Final

PLAIN: Final = 0
SPECULATING: Final = 1


class StepCosts:
    """Per kind of step, the measured seconds over the profile's price, as the median over
    the last ``window`` clean steps of that kind together with ``prior`` pseudo-steps at the
    pooled scale: the median over both kinds' windows with ``prior`` pseudo-steps at 1.0
    (the profile as measured). A few steps move nothing; a window of them moves the scale to
    what they show; one slow step (a page fault, a collector pause) never does. The pooled
    prior matters where one kind has no evidence (an engine that speculated on every step
    never timed a plain one): that kind then moves with the machine's speed as the other
    measures it, so a machine faster at everything alike changes no choice. A step whose
    time is not its own (it captured a CUDA graph, ran a prompt's chunk, loaded or saved
    cache) is left out (``clean=False``)."""

    def __init__(self, window: int, prior: int) -> None:
        if window < 1 or prior < 0:
            raise ValueError(f"need window >= 1 and prior >= 0, got {window}, {prior}")
        self.prior = prior
        self._ratios: tuple[deque[float], deque[float]] = (deque(maxlen=window), deque(maxlen=window))
        self._scales = [1.0, 1.0]
        self._pending: tuple[int, float] | None = None
        self.steps = [0, 0]  # clean steps observed, per kind

    def price(self, kind: int, seconds: float) -> None:
        """The step about to run is of ``kind`` and the profile prices it at ``seconds``."""
        self._pending = (kind, seconds) if seconds > 0 else None

    def unpriced(self) -> None:
        """The step about to run has no price in the profile: its time is not compared."""
        self._pending = None

    def observe(self, seconds: float, clean: bool = True) -> None:
        """The step last priced took ``seconds``."""
        pending, self._pending = self._pending, None
        if pending is None or not clean or seconds <= 0:
            return
        kind, priced = pending
        self._ratios[kind].append(seconds / priced)
        self.steps[kind] += 1
        plain, spec = self._ratios
        pooled = statistics.median([*plain, *spec, *([1.0] * self.prior)])
        self._scales = [statistics.median([*r, *([pooled] * self.prior)]) for r in self._ratios]

    def scale(self, kind: int) -> float:
        """What the profile's prices of ``kind`` are multiplied by (1.0 before evidence)."""
        return self._scales[kind]
