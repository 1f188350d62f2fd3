"""DSpark's asynchronous variant: it schedules with confidences two steps old (the newest
step's are still being computed when the next is scheduled); :class:`LaggedConfidence` keeps
them per request and hands out the lagged ones, with a population-mean fallback. What the
policy (`engine.spec.policy`, ``"dspark-lagged"``) and the simulator feed
`engine.spec.dspark`'s selection. Pure numpy; nothing here imports torch or the engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from engine.spec.dspark import FloatArray, as_confidences


class LaggedConfidence:
    """Per request, the confidences of its last ``lag`` steps; hands out the oldest.

    In the asynchronous pipeline the confidences of step ``t-1`` are still being computed
    when step ``t`` is scheduled, so the newest usable ones are ``lag = 2`` steps old.
    Call :meth:`record` once per step a request took part in (with that step's
    confidences) and :meth:`get` when scheduling it.

    Fallback for a request with fewer than ``lag`` recorded steps (or for draft positions
    its lagged record lacks): the per-position mean of the lagged confidences of all
    requests currently tracked that have them; if none has, ``prior`` (default 1.0: treat
    the drafts as certain, i.e. verify them all, like fixed-K, until evidence arrives).
    Ages count the request's own recorded steps, not global steps.
    """

    def __init__(self, lag: int = 2, prior: float = 1.0) -> None:
        if lag < 1:
            raise ValueError("lag must be >= 1")
        if not 0.0 <= prior <= 1.0:
            raise ValueError("prior must be in [0, 1]")
        self.lag = lag
        self.prior = prior
        self._hist: dict[Hashable, deque[FloatArray]] = {}

    def record(self, rid: Hashable, conf: npt.ArrayLike) -> None:
        """Confidences produced for ``rid`` in the step just finished."""
        self.record_batch((rid,), (as_confidences(conf).copy(),))

    def record_batch(self, rids: Sequence[Hashable], conf: Sequence[FloatArray]) -> None:
        """`record` for a step's requests at once (rows validated together; each row is
        kept as given, so the caller hands over arrays it no longer writes to)."""
        if conf:
            as_confidences(np.concatenate(conf))
        hist = self._hist
        for rid, c in zip(rids, conf):
            h = hist.get(rid)
            if h is None:
                h = hist[rid] = deque(maxlen=self.lag)
            h.append(c)

    def drop(self, rid: Hashable) -> None:
        """Forget a finished request."""
        self._hist.pop(rid, None)

    def age(self, rid: Hashable) -> int:
        h = self._hist.get(rid)
        return len(h) if h is not None else 0

    def __len__(self) -> int:
        return len(self._hist)

    def _population_mean(self, n: int) -> FloatArray:
        sums = np.zeros(n)
        counts = np.zeros(n)
        for h in self._hist.values():
            if len(h) == self.lag:
                c = h[0][:n]
                sums[: c.size] += c
                counts[: c.size] += 1
        return np.where(counts > 0, sums / np.maximum(counts, 1), self.prior)

    def get(self, rid: Hashable, n_drafts: int) -> FloatArray:
        """Confidences to schedule ``rid``'s ``n_drafts`` drafts with (``lag`` steps old)."""
        return self.get_batch((rid,), (n_drafts,))[0]

    def get_batch(self, rids: Sequence[Hashable], n_drafts: Sequence[int]) -> list[FloatArray]:
        """`get` for each request (the population mean, where needed, computed once)."""
        out: list[FloatArray] = []
        mean: FloatArray | None = None
        for rid, n in zip(rids, n_drafts):
            h = self._hist.get(rid)
            lagged = h[0][:n] if h is not None and len(h) == self.lag else np.zeros(0)
            if lagged.size == n:
                out.append(lagged.copy())
                continue
            if mean is None:
                mean = self._population_mean(max(n_drafts))
            row = mean[:n].copy()
            row[: lagged.size] = lagged
            out.append(row)
        return out
