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

from bisect import bisect_left, insort
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
        # per kind, the last ``window`` ratios (`_Window`: the medians are read from them
        # sorted, so a step's observation costs a few bisections, not three sorts of a
        # hundred floats, on the host between two steps)
        self._ratios = (_Window(window), _Window(window))
        self._pooled: list[float] = []  # both kinds' windows together, sorted
        self._scales = [1.0, 1.0]
        self._pending: tuple[int, float] | None = None
        self.steps = [0, 0]  # clean steps observed, per kind
        # the policy's own host seconds in a speculating step (its choice: `observe_host`), the
        # median of the last ``window``; the profile's steps were timed under a fixed policy,
        # whose choice costs a few tens of microseconds, so this is what it leaves out
        self.host = 0.0
        self._host = _Window(window)

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
        if kind == SPECULATING:  # the policy's own host time is not the profile's to scale
            seconds = max(seconds - self.host, 1e-3 * priced)
        ratio = seconds / priced
        left = self._ratios[kind].add(ratio)
        if left is not None:  # the oldest leaves the pooled values too
            del self._pooled[bisect_left(self._pooled, left)]
        insort(self._pooled, ratio)
        self.steps[kind] += 1
        pooled = _median_with(self._pooled, 1.0, self.prior)
        self._scales = [
            _median_with(w.sorted, pooled, self.prior) if w.sorted or self.prior else scale
            for w, scale in zip(self._ratios, self._scales)
        ]

    def observe_host(self, seconds: float) -> None:
        """The policy's choice in a speculating step took ``seconds`` of host time."""
        self._host.add(seconds)
        self.host = _median_with(self._host.sorted, 0.0, 0)

    def speculating(self, seconds: float) -> float:
        """What a speculating step the profile prices at ``seconds`` costs now: scaled as
        measured, with the policy's own host time."""
        return seconds * self._scales[SPECULATING] + self.host

    def scale(self, kind: int) -> float:
        """What the profile's prices of ``kind`` are multiplied by (1.0 before evidence)."""
        return self._scales[kind]


class _Window:
    """The last ``size`` values in arrival order, and the same values sorted."""

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []

    def add(self, value: float) -> float | None:
        """Adds ``value``; returns the oldest, where it left to make room."""
        left = None
        if len(self._order) == self._order.maxlen:
            left = self._order[0]
            del self.sorted[bisect_left(self.sorted, left)]
        self._order.append(value)
        insort(self.sorted, value)
        return left


def _median_with(ordered: list[float], value: float, count: int) -> float:
    """The median of the sorted ``ordered`` with ``count`` more copies of ``value`` (what
    ``statistics.median`` returns for that list, without building it)."""
    at = bisect_left(ordered, value)  # the copies sit at ordered[at:at], ties alike
    n = len(ordered) + count
    hi = n // 2
    upper = ordered[hi] if hi < at else value if hi < at + count else ordered[hi - count]
    if n % 2:
        return upper
    lo = hi - 1
    return (upper + (ordered[lo] if lo < at else value if lo < at + count else ordered[lo - count])) / 2
