"""The step table DSpark prices a step with: profiled steps per second against tokens in a
step (:class:`StepProfile`, linearly interpolated, clamped at the ends), and the expected
throughput of a choice, ``expected_total * steps_per_s(T)`` (:func:`throughput`). Used by
`engine.spec.dspark` (the scheduling core), `engine.spec.profile` (the measured profile
hands out one table per batch) and `engine.spec.simulate`. Pure numpy; nothing here imports
torch or the engine.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class StepProfile:
    """Profiled steps per second against tokens in a step, linearly interpolated.

    ``tokens`` strictly increasing and positive; ``steps_per_s`` positive, finite and
    non-increasing (a bigger step is never faster). Outside the table the end values are
    used (clamped).
    """

    tokens: tuple[float, ...]
    rates: tuple[float, ...]
    # rate_at's results: a scheduler asks each table for the same few token counts every step
    # (one per token count a step of the table's batch can have), kept up to MEMO_SIZE
    _memo: dict[float, float] = field(default_factory=dict, init=False, compare=False, repr=False)
    MEMO_SIZE: ClassVar[int] = 4096

    def __init__(self, tokens: Iterable[float], steps_per_s: Iterable[float]) -> None:
        t = tuple(float(x) for x in tokens)
        s = tuple(float(x) for x in steps_per_s)
        if not t or len(t) != len(s):
            raise ValueError(f"need equal, non-empty tokens and steps_per_s ({len(t)} vs {len(s)})")
        if not all(math.isfinite(x) and x > 0 for x in t):
            raise ValueError("token counts must be finite and positive")
        if any(b <= a for a, b in zip(t, t[1:])):
            raise ValueError("token counts must be strictly increasing")
        if not all(math.isfinite(x) and x > 0 for x in s):
            raise ValueError("steps_per_s must be finite and positive")
        if any(b > a for a, b in zip(s, s[1:])):
            raise ValueError("steps_per_s must be non-increasing in tokens")
        object.__setattr__(self, "tokens", t)
        object.__setattr__(self, "rates", s)
        object.__setattr__(self, "_memo", {})

    def steps_per_s(self, tokens: npt.ArrayLike) -> Any:
        """Steps per second at ``tokens`` (scalar -> float, array -> array)."""
        out = np.interp(np.asarray(tokens, dtype=np.float64), self.tokens, self.rates)
        return float(out) if np.ndim(out) == 0 else out

    def rate_at(self, tokens: float) -> float:
        """`steps_per_s` of one token count in plain Python, as ``np.interp`` computes it (its
        formula, so the two agree to the bit): a scheduler's one-request step avoids numpy's
        per-call cost; memoised)."""
        hit = self._memo.get(tokens)
        if hit is None:
            hit = self._rate_at(tokens)
            if len(self._memo) < self.MEMO_SIZE:  # bounded, whatever a caller asks for
                self._memo[tokens] = hit
        return hit

    def _rate_at(self, tokens: float) -> float:
        t, r = self.tokens, self.rates
        if tokens <= t[0]:
            return r[0]
        if tokens >= t[-1]:
            return r[-1]
        j = bisect.bisect_right(t, tokens) - 1
        if t[j] == tokens:
            return r[j]
        return (r[j + 1] - r[j]) / (t[j + 1] - t[j]) * (tokens - t[j]) + r[j]

    def seconds(self, tokens: npt.ArrayLike) -> Any:
        """Seconds of one step of ``tokens`` tokens (``1 / steps_per_s``)."""
        out = 1.0 / np.interp(np.asarray(tokens, dtype=np.float64), self.tokens, self.rates)
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, list[float]]:
        return {"tokens": list(self.tokens), "steps_per_s": list(self.rates)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepProfile:
        return cls(d["tokens"], d["steps_per_s"])

    @classmethod
    def from_cost_model(cls, seconds: Callable[[float], float], points: Iterable[float]) -> StepProfile:
        """Sample a step-time model ``seconds(tokens)`` at ``points`` (sorted, deduplicated)."""
        pts = sorted(set(float(p) for p in points))
        return cls(pts, [1.0 / float(seconds(p)) for p in pts])


def monotone_fit(values: Iterable[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent
    violators): a run that falls below an earlier value is replaced, with that value, by their
    mean. A profile's step times are medians of a few steps each, so one cell can read above
    its larger neighbour by noise alone; the fit removes that without the upward bias of a
    running maximum, which would carry one high cell into every larger step."""
    blocks: list[list[float]] = []  # [mean, count], means strictly increasing
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] >= blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def throughput(expected_total: float, tokens: float, profile: StepProfile) -> float:
    """Expected accepted tokens per second: ``expected_total * steps_per_s(tokens)``."""
    return float(expected_total) * float(profile.steps_per_s(tokens))
