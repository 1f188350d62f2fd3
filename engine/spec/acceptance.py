"""What a speculation policy knows of its drafts' acceptance, per draft position.

Decayed counts of the requests that tried a position and of those whose draft there was
accepted, and of the confidence head's predictions (over every draft, and over the tried
ones alone). From them: the acceptance rate per position (`DraftAcceptance.rates`), the
head's mean prediction (`head_means`) and how far the head's predictions are from the
outcomes (`calibration`). `engine.spec.policy.SpecPolicy` decides with them.

Plain lists of a few floats, updated on the host every step: each numpy call would cost
more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DraftAcceptance:
    """``positions``: drafts per request at most; ``prior_weight``: pseudo-observations of
    the head's own predictions that the rates and the calibration start from."""

    def __init__(self, positions: int, prior_weight: float) -> None:
        k = positions
        self.prior_weight = prior_weight
        # decayed: requests that tried each position, that had it accepted; the head's
        # predictions (sum, count) over every draft, and their sum over the tried drafts
        self.hits, self.tries = [0.0] * k, [0.0] * k
        self.conf_sum, self.conf_n, self.conf_tried = [0.0] * k, [0.0] * k, [0.0] * k
        # outcomes not yet folded into tries and hits: requests per count of positions tried
        # (index 0..positions) and per count accepted (`add_outcome`, `fold`)
        self._tried_n = [0] * (k + 1)
        self._hit_n = [0] * (k + 1)
        self._unfolded = False
        self.version = 0  # changes whenever anything the rates or head means rest on does

    def decay(self, factor: float) -> None:
        """Fades every count by ``factor`` (a step with drafts to verify)."""
        self.fold()
        self.version += 1
        for acc in (self.hits, self.tries, self.conf_sum, self.conf_n, self.conf_tried):
            acc[:] = [x * factor for x in acc]

    def add_predictions(
        self, rows: np.ndarray | Sequence[Sequence[float] | np.ndarray], n: Sequence[int]
    ) -> None:
        """The head's predictions of one step: ``rows`` is one [B, K] array when every request
        has K drafts (``n``: drafts per request), else one sequence per request."""
        m = len(self.conf_sum)
        self.version += 1
        if isinstance(rows, np.ndarray):
            sums = rows[0, :m].tolist() if len(n) == 1 else rows[:, :m].sum(axis=0).tolist()
            for j, v in enumerate(sums):
                self.conf_sum[j] += v
                self.conf_n[j] += len(n)
            return
        for c in rows:
            for j, v in enumerate(c[:m]):
                self.conf_sum[j] += float(v)
                self.conf_n[j] += 1

    def add_outcome(self, conf: Sequence[float], k: int, accepted: int) -> None:
        """One request's verification: of its ``k`` verified drafts (predicted ``conf``),
        ``accepted`` were; positions 1 .. min(k, accepted + 1) were tried, 1 .. min(k,
        accepted) accepted (counted here, added to the rates by `fold`)."""
        tried = min(k, accepted + 1)
        self.version += 1
        self._tried_n[tried] += 1
        self._hit_n[min(k, accepted)] += 1
        for j in range(tried):
            self.conf_tried[j] += float(conf[j])
        self._unfolded = True

    def fold(self) -> None:
        """Adds the outcomes counted since the last fold to the per-position tries and hits:
        a request that tried ``t`` positions tried each of positions 1 .. t."""
        if not self._unfolded:
            return
        for counts, acc in ((self._tried_n, self.tries), (self._hit_n, self.hits)):
            run = 0
            for t in range(len(acc), 0, -1):  # requests that tried at least t positions
                run += counts[t]
                acc[t - 1] += run
            counts[:] = [0] * len(counts)
        self._unfolded = False

    def rates(self) -> list[float] | None:
        """P(draft j accepted | drafts before it accepted) per position: the observed rate,
        smoothed towards the head's mean prediction for that position by ``prior_weight``
        pseudo-observations (None before any outcome)."""
        self.fold()
        if self.tries[0] == 0:
            return None
        w = self.prior_weight
        return [
            (h + w * (cs / max(cn, 1e-12) if cn > 0 else 0.5)) / (t + w)
            for h, t, cs, cn in zip(self.hits, self.tries, self.conf_sum, self.conf_n)
        ]

    def head_means(self) -> list[float]:
        """The head's mean prediction per position (what `rates` is smoothed towards; 0.5
        before any prediction), for the rates before any draft has an outcome."""
        return [cs / cn if cn > 0 else 0.5 for cs, cn in zip(self.conf_sum, self.conf_n)]

    def calibration(self) -> list[float]:
        """Per position, what the head's predictions are multiplied by: the accepted drafts
        over the head's predicted sum for the same tried drafts (positions reached and
        verified, where an outcome exists), each side with ``prior_weight`` pseudo-
        observations of a calibrated head (1.0 without evidence). Survivals are products of
        confidences, so a head a few points over-confident at every position overstates a
        deep draft's survival by the product of its errors, and DSpark then verifies deeper
        than pays; this rescales the head's mean to the outcomes (calibration in the large,
        per position), keeping its ranking within a position."""
        self.fold()
        w = self.prior_weight
        return [(h + w) / (s + w) for h, s in zip(self.hits, self.conf_tried)]

    def calibrated(self, conf: np.ndarray | list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        """``conf`` scaled by `calibration` per position, capped at 1."""
        f = np.array(self.calibration())
        if isinstance(conf, np.ndarray):
            return np.minimum(conf * f[: conf.shape[1]], 1.0)
        return [np.minimum(c * f[: c.size], 1.0) for c in conf]
