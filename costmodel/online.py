"""The decode cost model refitted from the steps an engine runs while serving (pure numpy).

``DecodeCostModel.fit`` fits ``d0 + d1*B + d2*K`` to a profiled table by least squares on
relative error: each sample ``(B, K, t)`` is a row ``z = (1, B, K) / t`` with target 1. The
same fit over the decode steps an engine serves needs only the sufficient statistics
of those rows, ``DecodeStepSums``:

    W = sum w,   A = sum w z z^T  (3 x 3),   b = sum w z,   and sum w t, sum w B, sum w K

(13 numbers). An engine adds each step it runs and pushes the sums with its load
(``to_extra``); a router adds the sums of the engines of one pool, which is the fit over
all their steps (engines of one pool run one model on one kind of hardware).

**Old steps fade**: each new step multiplies the sums by ``2 ** (-1 / half_life)``, so a
change of hardware state (clocks, a neighbour on a shared host) is followed within a few
half-lives. One half-life (``HALF_LIFE_STEPS``) is the window of latest steps an engine
keeps for its metrics (``EngineLoop.stats``): at 10-50 ms a step, one to three minutes of
serving, over which the load moves through many batch sizes and depths.

**A step slower than the model is bounded in its pull**: its residual ``z . theta - 1`` is
``predicted / t - 1``, which lies in ``(-1, 0]`` however slow the step was (a garbage-collection
pause, a neighbour's burst on a shared host), while a step faster than predicted pulls in
proportion. Timings only ever gain time from interference, so this asymmetry suits them.

``posterior(prior, sums)`` is the refitted model (the router reports it beside the model it
places with): the least squares above with a Gaussian prior around the model it had
(the profiled table's fit, or the default).
The prior lets every coefficient move by ``PRIOR_REL_SD`` of a typical measured step (its
standard deviation for coefficient j is ``PRIOR_REL_SD * mean(t) / mean(x_j)``): a prior
measured on other hardware is trusted to the order of magnitude and no further. Where the
steps determine a direction (they always vary in K; B varies with the load) the steps
rule; where they do not (an engine that only ever ran one batch size cannot tell ``d0``
from ``d1 * B``) the prior stays. With no steps the posterior is the prior.

``keep_d2``: the prior's ``d2`` is kept, and ``d0`` and ``d1`` are refitted around it: what
served steps add to a table measured on the same hardware, if the table's per-KV-token
cost is trusted (a table varies batch and depth apart; served traffic mostly moves them
together, so a refit of all three tells ``d1`` from ``d2`` only loosely). ``sluice bench
router --online-fit`` compares both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from costmodel.models import DecodeCostModel

HALF_LIFE_STEPS = 4096.0
PRIOR_REL_SD = 1.0
# relative residuals are never believed smaller than this: a step's timer and the engine's
# own variation leave about 1 % (a profiled table's cells spread 3-20 % on shared CPUs)
MIN_REL_NOISE = 0.01
_KEYS = ("w", "a00", "a01", "a02", "a11", "a12", "a22", "b0", "b1", "b2", "t", "batch", "kv")
EXTRA_PREFIX = "decode_steps_"


@dataclass
class DecodeStepSums:
    """Sufficient statistics of the relative-error decode fit over (faded) served steps."""

    half_life: float = HALF_LIFE_STEPS
    w: float = 0.0  # sum of weights: the effective number of steps
    a: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    b: np.ndarray = field(default_factory=lambda: np.zeros(3))
    t: float = 0.0  # sum w * seconds
    batch: float = 0.0  # sum w * B
    kv: float = 0.0  # sum w * K

    def __post_init__(self) -> None:
        if not (self.half_life > 0):
            raise ValueError(f"half_life must be > 0 steps, got {self.half_life!r}")

    def add(self, batch: int, kv_tokens: int, seconds: float) -> None:
        """One decode step: ``batch`` sequences reading ``kv_tokens`` KV tokens took
        ``seconds``. A step that cannot be a measurement (no sequence, no time) is ignored."""
        if batch < 1 or kv_tokens < 0 or not (seconds > 0) or not math.isfinite(seconds):
            return
        keep = 2.0 ** (-1.0 / self.half_life)
        z = np.array([1.0, float(batch), float(kv_tokens)]) / seconds
        self.w = self.w * keep + 1.0
        self.a = self.a * keep + np.outer(z, z)
        self.b = self.b * keep + z
        self.t = self.t * keep + seconds
        self.batch = self.batch * keep + batch
        self.kv = self.kv * keep + kv_tokens

    def __add__(self, other: DecodeStepSums) -> DecodeStepSums:
        return DecodeStepSums(
            self.half_life, self.w + other.w, self.a + other.a, self.b + other.b, self.t + other.t,
            self.batch + other.batch, self.kv + other.kv,
        )  # fmt: skip

    def rel_rmse(self, model: DecodeCostModel) -> float:
        """Root-mean-square relative error of ``model`` over the summed steps (nan: none)."""
        if self.w <= 0:
            return math.nan
        theta = np.array([model.d0, model.d1, model.d2])
        sse = float(theta @ self.a @ theta - 2.0 * self.b @ theta + self.w)
        return math.sqrt(max(sse, 0.0) / self.w)

    # -- the engine's pushed load: flat floats ----------------------------------------------
    def to_extra(self) -> dict[str, float]:
        a = self.a
        values = (
            self.w, a[0, 0], a[0, 1], a[0, 2], a[1, 1], a[1, 2], a[2, 2], *self.b, self.t, self.batch, self.kv,
        )  # fmt: skip
        return {EXTRA_PREFIX + k: float(v) for k, v in zip(_KEYS, values)}

    @classmethod
    def from_extra(cls, extra: Mapping[str, float], half_life: float = HALF_LIFE_STEPS) -> DecodeStepSums:
        """The sums in an engine's pushed ``extra``; empty when it pushes none (an older
        engine) or pushes values that cannot be sums (not finite, negative weight)."""
        try:
            v = {k: float(extra[EXTRA_PREFIX + k]) for k in _KEYS}
        except (KeyError, TypeError, ValueError):
            return cls(half_life)
        if not all(math.isfinite(x) for x in v.values()) or v["w"] < 0:
            return cls(half_life)
        a = np.array([
            [v["a00"], v["a01"], v["a02"]], [v["a01"], v["a11"], v["a12"]], [v["a02"], v["a12"], v["a22"]],
        ])  # fmt: skip
        b = np.array([v["b0"], v["b1"], v["b2"]])
        return cls(half_life, v["w"], a, b, v["t"], v["batch"], v["kv"])


def posterior(
    prior: DecodeCostModel, sums: DecodeStepSums, keep_d2: bool = False, prior_rel_sd: float = PRIOR_REL_SD
) -> DecodeCostModel:
    """The decode cost model given ``sums``' steps and ``prior`` (module docstring):
    coefficients no lower than 0 (solved for under that bound, not clipped to it:
    `_nonnegative_minimum`); ``prior`` itself when there are no steps. ``keep_d2``: the
    prior's ``d2`` is kept and only ``d0`` and ``d1`` are refitted."""
    if sums.w <= 0:
        return prior
    p = np.array([prior.d0, prior.d1, prior.d2])
    mean_t = sums.t / sums.w
    scale = mean_t / np.maximum(np.array([1.0, sums.batch / sums.w, sums.kv / sums.w]), 1e-12)
    # solved in units of each term's share of a typical step (theta = scale * u): the
    # coefficients differ by ten orders of magnitude, the shares do not
    prec_u = 1.0 / prior_rel_sd**2  # the prior's precision on each share
    a_u = sums.a * np.outer(scale, scale)
    b_u = sums.b * scale
    p_u = p / scale
    free = 2 if keep_d2 else 3  # the coefficients solved for: (d0, d1) or (d0, d1, d2)
    a_f = a_u[:free, :free]
    b_f = b_u[:free] - (a_u[:free, 2] * p_u[2] if keep_d2 else 0.0)  # the kept term's share moved right
    noise = max(sums.rel_rmse(prior) ** 2, MIN_REL_NOISE**2)  # start from the prior's misfit
    model = prior
    for _ in range(3):  # the residual noise and the coefficients, each given the other
        u = p_u.copy()
        u[:free] = _nonnegative_minimum(
            a_f / noise + prec_u * np.eye(free), b_f / noise + prec_u * p_u[:free]
        )
        theta = np.maximum(u * scale, 0.0)  # the kept d2 too
        if not np.any(theta > 0):
            return prior
        model = DecodeCostModel(*(float(x) for x in theta))
        noise = max(sums.rel_rmse(model) ** 2 * sums.w / max(sums.w - free, 1.0), MIN_REL_NOISE**2)
    return model


def _nonnegative_minimum(h: np.ndarray, c: np.ndarray) -> np.ndarray:
    """argmin of ``u' h u - 2 c' u`` over ``u >= 0``, ``h`` positive definite and at most 3 x 3:
    every choice of the coefficients held at 0 is solved and the best feasible one kept (the
    convex problem's minimum is one of them). Clipping the unconstrained solution instead
    can land above the prior's own error, where the constrained minimum never does (the
    prior is feasible)."""
    n = len(c)
    best, best_value = np.zeros(n), 0.0
    for mask in range(1, 1 << n):
        kept = [i for i in range(n) if mask >> i & 1]
        u_kept = np.linalg.solve(h[np.ix_(kept, kept)], c[kept])
        if np.all(u_kept >= 0) and -float(c[kept] @ u_kept) < best_value:
            best, best_value = np.zeros(n), -float(c[kept] @ u_kept)
            best[kept] = u_kept
    return best
