"""DSpark: confidence-scheduled speculative decoding, the pure scheduling core.

The draft (MTP layer) proposes up to ``max_k`` tokens per sequence per step and a confidence
head predicts, for request ``r`` and draft position ``j`` (1-based), the probability
``c(r, j)`` that draft ``j`` is accepted given that drafts ``1..j-1`` were. Then

* survival ``a(r, j) = prod_{i<=j} c(r, i)``: the probability that drafts ``1..j`` are all
  accepted (non-increasing in ``j``);
* verifying the first ``k_r`` drafts costs ``k_r + 1`` tokens of the verification batch and
  yields ``E_r(k_r) = 1 + sum_{j<=k_r} a(r, j)`` expected tokens (the 1 is the token the
  target always produces);
* a choice ``{k_r}`` has expected throughput ``(sum_r E_r(k_r)) * steps_per_s(T)`` with
  ``T = sum_r (k_r + 1)``, ``steps_per_s`` from a profiled :class:`StepProfile`
  (`engine.spec.step_table`, which has :func:`throughput` too).

**Optimality** (what :func:`plan_dspark` computes, and what the tests check against brute
force). Write ``D = sum_r k_r`` (so ``T = B + D``). For a fixed ``D`` the throughput is
``(B + sum of the admitted a(r, j)) * steps_per_s(B + D)``, maximised by admitting the ``D``
largest survivals. Because ``a(r, j)`` is non-increasing in ``j``, the ``D`` largest
(ties broken by smaller ``j``) are prefix-closed, so they are a valid choice: greedy
admission by decreasing ``a(r, j)`` is optimal for every ``D``. Evaluating the throughput
of each greedy prefix ``D = 0..N`` and taking the argmax (smallest ``D`` among ties) is
therefore the global optimum over all ``{k_r}``. The paper's rule "stop when throughput
stops rising" (``stop="first_peak"``) reaches the same point whenever the throughput of
the greedy prefixes is unimodal in ``D``, which holds for an affine step time
``seconds(T) = c0 + c1 * T`` (each step's marginal test ``a_{D+1} > c1 * thr(D)`` fails
forever once it fails, by the mediant inequality) but not for an arbitrary profiled table,
so the default is the argmax.

Cost: one sort of the ``N <= B * max_k`` survivals plus vectorised cumsum / interpolation,
``O(N log N)``.

Baselines: :func:`select_fixed` (``k_r = min(K, n_r)``), :func:`select_oracle` (``k_r = L_r``,
the true accepted length: it verifies exactly the drafts that will be accepted, so every
verified token is accepted; this maximises accepted tokens per verified token, not
necessarily throughput), no speculation (``k_r = 0``, :func:`select_fixed` with ``K = 0``).
:func:`choose_policy` picks between DSpark and fixed-K by predicted throughput.

The asynchronous variant schedules with confidences two steps old;
`engine.spec.lagged.LaggedConfidence` keeps them. Pure numpy; nothing here imports torch or
the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from engine.spec.step_table import StepProfile, throughput

#: Up to this many requests, `plan_dspark_depths` runs in plain Python (`plan_rows_depths`):
#: below it numpy's fixed cost per call outweighs the per-element work it saves
#: (scripts/spec_choose_cost.py, docs/speculative.md, "The choice's own host time").
FEW_REQUESTS = 16

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Confidences = Sequence[npt.ArrayLike] | npt.NDArray[Any]

# ---------------------------------------------------------------------------------------
# Survival and expected accepted tokens
# ---------------------------------------------------------------------------------------


def as_confidences(c: npt.ArrayLike) -> FloatArray:
    """One request's confidences as a flat float64 array; ValueError unless each is a finite
    probability in [0, 1]."""
    arr = np.asarray(c, dtype=np.float64).reshape(-1)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0.0 or arr.max() > 1.0):
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    return arr


def survival(conf: npt.ArrayLike) -> FloatArray:
    """``a[j-1] = prod_{i<=j} conf[i-1]`` for one request (cumulative products)."""
    return _cumprod(as_confidences(conf))


def _cumprod(c: npt.NDArray[np.float64]) -> FloatArray:
    return np.asarray(np.cumprod(c, axis=-1), dtype=np.float64)


def expected_accepted(a: npt.ArrayLike, k: int) -> float:
    """``E(k) = 1 + sum_{j<=k} a(j)`` for one request's survivals ``a``."""
    arr = np.asarray(a, dtype=np.float64).reshape(-1)
    if k < 0 or k > arr.size:
        raise ValueError(f"k={k} outside 0..{arr.size}")
    return 1.0 + float(arr[:k].sum())


def _padded(conf: Confidences) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
    """[B, K] confidences (1.0 where a request has no such draft) and the mask of real drafts."""
    if isinstance(conf, np.ndarray) and conf.ndim == 2:
        c = conf.astype(np.float64, copy=False)
        mask = np.ones(c.shape, dtype=bool)
    else:
        rows = [np.asarray(x, dtype=np.float64).reshape(-1) for x in conf]
        lengths = np.fromiter((r.size for r in rows), dtype=np.int64, count=len(rows))
        kmax = int(lengths.max()) if lengths.size else 0
        mask = np.arange(kmax)[None, :] < lengths[:, None]
        c = np.ones((len(rows), kmax), dtype=np.float64)
        if kmax:
            c[mask] = np.concatenate(rows)
    if c.size and (not np.all(np.isfinite(c)) or c.min() < 0.0 or c.max() > 1.0):
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    return c, mask


# ---------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DSparkPlan:
    """One DSpark decision: ``ks[r]`` drafts to verify per request and its prediction."""

    ks: IntArray
    expected_accepted: float  # sum_r E_r(k_r)
    tokens: int  # T = sum_r (k_r + 1)
    throughput: float  # expected accepted tokens per second


def _plan(
    a: FloatArray,
    mask: npt.NDArray[np.bool_],
    profile: StepProfile,
    max_tokens: int | None,
    stop: str,
) -> DSparkPlan:
    batch = a.shape[0]
    if batch == 0:
        return DSparkPlan(np.zeros(0, dtype=np.int64), 0.0, 0, 0.0)
    rows = np.nonzero(mask)[0]  # row-major: j ascending within each request
    cand = a[mask]
    # stable: ties keep j ascending (and equal survivals give equal E whatever the order, as
    # only the per-request counts are used), so the admitted set is prefix-closed
    order = np.argsort(-cand, kind="stable")
    n = cand.size
    if max_tokens is not None:
        n = max(0, min(n, int(max_tokens) - batch))
    return _best_prefix(cand, rows, order[:n], batch, profile, stop)


def _best_prefix(
    cand: FloatArray, rows: IntArray, admitted: IntArray, batch: int, profile: StepProfile, stop: str
) -> DSparkPlan:
    """The best prefix of the candidates ``admitted`` (indices into ``cand`` / ``rows``, in
    greedy order) by expected throughput, under the stop rule."""
    n = admitted.size
    expected = np.empty(n + 1, dtype=np.float64)
    expected[0] = 0.0
    np.cumsum(cand[admitted], out=expected[1:])
    expected += batch
    thr = expected * profile.steps_per_s(batch + np.arange(n + 1, dtype=np.float64))
    if stop == "argmax":
        d = int(np.argmax(thr))  # first maximum: the fewest tokens among ties
    elif stop == "first_peak":
        falls = np.nonzero(thr[1:] <= thr[:-1])[0]
        d = int(falls[0]) if falls.size else n
    else:
        raise ValueError(f"unknown stop rule {stop!r}")
    ks = np.bincount(rows[admitted[:d]], minlength=batch).astype(np.int64)
    return DSparkPlan(ks, float(expected[d]), batch + d, float(thr[d]))


def plan_dspark(
    conf: Confidences,
    profile: StepProfile,
    *,
    max_tokens: int | None = None,
    stop: Literal["argmax", "first_peak"] = "argmax",
) -> DSparkPlan:
    """Greedy admission of ``(r, j)`` by decreasing survival; the best prefix by throughput.

    ``conf``: per request an array of its drafts' confidences (lengths may differ, 0 allowed),
    or a [B, K] array. ``max_tokens`` caps ``T`` (never below ``B``: every request's own
    token is always verified). ``stop``: "argmax" (global optimum, see the module doc) or
    "first_peak" (stop at the first greedy step that does not raise throughput).
    """
    if len(conf) == 1:
        return _plan_one(conf[0], profile, max_tokens, stop)
    c, mask = _padded(conf)
    return _plan(_cumprod(c), mask, profile, max_tokens, stop)


def plan_dspark_depths(conf: npt.ArrayLike, tables: Sequence[StepProfile]) -> list[DSparkPlan]:
    """`plan_dspark` at every drafting depth: plan ``d`` (1-based) selects among the first
    ``d`` drafts of each request of ``conf`` [B, K] (``K >= len(tables)``), priced by
    ``tables[d - 1]`` (the step of a batch that drafts ``d``). One sort serves every depth:
    the survivals of the first ``d`` drafts keep their order within the sorted whole, so
    each plan equals ``plan_dspark(conf[:, :d], tables[d - 1])`` to the bit."""
    c = np.asarray(conf, dtype=np.float64)
    if c.ndim != 2 or c.shape[1] < len(tables):
        raise ValueError(f"need [B, K >= {len(tables)}] confidences, got shape {c.shape}")
    batch, k = c.shape
    if batch <= FEW_REQUESTS:
        return plan_rows_depths(c.tolist(), tables)
    c, _ = _padded(c)  # validated
    cand = _cumprod(c).ravel()  # row-major: j ascending within each request
    rows = np.repeat(np.arange(batch), k)
    order = np.argsort(-cand, kind="stable")
    col = np.tile(np.arange(k), batch)[order]
    return [
        _best_prefix(cand, rows, order[col < d], batch, table, "argmax")
        for d, table in enumerate(tables, start=1)
    ]


def _plan_one(row: Any, profile: StepProfile, max_tokens: int | None, stop: str) -> DSparkPlan:
    """`_plan` for one request, in plain Python (a scheduler at one request runs it every
    step, where numpy's per-call cost would be most of the time). Its survivals fall with
    the draft position, so the greedy order is the positional one; sums and products run in
    `_plan`'s order, so the two agree to the bit."""
    vals = [float(x) for x in row]
    if not all(0.0 <= x <= 1.0 for x in vals):  # NaN fails the comparison too
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    n = len(vals) if max_tokens is None else max(0, min(len(vals), int(max_tokens) - 1))
    if stop not in ("argmax", "first_peak"):
        raise ValueError(f"unknown stop rule {stop!r}")
    surv = cum = 0.0
    best = (0, 1.0, 1.0 * profile.rate_at(1.0))  # (drafts, expected, throughput)
    prev = best[2]
    for j in range(n):
        surv = vals[0] if j == 0 else surv * vals[j]
        cum += surv
        expected = cum + 1.0
        thr = expected * profile.rate_at(2.0 + j)
        if stop == "first_peak" and thr <= prev:
            break
        if stop == "first_peak" or thr > best[2]:
            best = (j + 1, expected, thr)
        prev = thr
    d, expected, thr = best
    return DSparkPlan(np.array([d], dtype=np.int64), expected, 1 + d, thr)


def plan_rows_depths(rows: list[list[float]], tables: Sequence[StepProfile]) -> list[DSparkPlan]:
    """`plan_dspark_depths` of a few requests (``rows``: each one's confidences, all of the
    same length, at least ``len(tables)``) in plain Python: numpy's per-call cost was most of
    the array path's time at up to `FEW_REQUESTS` requests (at one request, the scheduler's
    every step). The same survivals, order, sums and interpolation in the same sequence, so
    each plan equals the array path's, and `_plan_one`'s at one request, to the bit."""
    batch, k = len(rows), len(rows[0]) if rows else 0
    cand: list[float] = []  # row-major: j ascending within each request
    for row in rows:
        if len(row) != k or not all(0.0 <= x <= 1.0 for x in row):  # NaN fails the comparison too
            raise ValueError("confidences must be finite probabilities in [0, 1], as many a request")
        surv = 1.0
        for j, x in enumerate(row):
            surv = x if j == 0 else surv * x
            cand.append(surv)
    # stable: ties keep their row-major order, as the array path's stable argsort does
    order = sorted(range(len(cand)), key=lambda i: -cand[i])
    plans = []
    for d, table in enumerate(tables, start=1):
        admitted = [i for i in order if i % k < d]
        best_n, best_e, best_thr = 0, float(batch), float(batch) * table.rate_at(batch)
        run = 0.0
        for n, i in enumerate(admitted, start=1):
            run += cand[i]
            expected = run + batch
            thr = expected * table.rate_at(batch + n)
            if thr > best_thr:  # the first maximum: the fewest tokens among ties
                best_n, best_e, best_thr = n, expected, thr
        ks = [0] * batch
        for i in admitted[:best_n]:
            ks[i // k] += 1
        plans.append(DSparkPlan(np.array(ks, dtype=np.int64), best_e, batch + best_n, best_thr))
    return plans


def select_dspark(
    conf: Confidences,
    profile: StepProfile,
    *,
    max_tokens: int | None = None,
    stop: Literal["argmax", "first_peak"] = "argmax",
) -> list[int]:
    """``k_r`` per request chosen by DSpark (see :func:`plan_dspark`)."""
    return plan_dspark(conf, profile, max_tokens=max_tokens, stop=stop).ks.tolist()


def select_fixed(n_drafts: Sequence[int] | npt.ArrayLike, K: int) -> list[int]:
    """Fixed-K speculation: ``k_r = min(K, n_r)``; ``K = 0`` is no speculation."""
    if K < 0:
        raise ValueError("K must be >= 0")
    n = np.asarray(n_drafts, dtype=np.int64).reshape(-1)
    if n.size and n.min() < 0:
        raise ValueError("draft counts must be >= 0")
    return np.minimum(n, K).tolist()


def select_oracle(
    accepted_lengths: Sequence[int] | npt.ArrayLike, n_drafts: Sequence[int] | npt.ArrayLike | None = None
) -> list[int]:
    """Oracle: ``k_r = L_r``, exactly the drafts that will be accepted (clipped to ``n_r``)."""
    lengths = np.asarray(accepted_lengths, dtype=np.int64).reshape(-1)
    if lengths.size and lengths.min() < 0:
        raise ValueError("accepted lengths must be >= 0")
    if n_drafts is not None:
        lengths = np.minimum(lengths, np.asarray(n_drafts, dtype=np.int64).reshape(-1))
    return lengths.tolist()


def _expected(a: FloatArray, mask: npt.NDArray[np.bool_], ks: IntArray) -> float:
    if ks.size != a.shape[0]:
        raise ValueError(f"{ks.size} ks for {a.shape[0]} requests")
    take = np.arange(a.shape[1])[None, :] < ks[:, None]
    if np.any(take & ~mask):
        raise ValueError("k_r exceeds the drafts available")
    return float(ks.size + a[take].sum())


def expected_total(conf: Confidences, ks: Sequence[int] | npt.ArrayLike) -> float:
    """``sum_r E_r(k_r)`` under the confidences (``k_r`` must not exceed ``r``'s drafts)."""
    c, mask = _padded(conf)
    return _expected(_cumprod(c), mask, np.asarray(ks, dtype=np.int64).reshape(-1))


def fixed_k_from_means(
    conf: Confidences, profile: StepProfile, max_k: int = 5, *, max_tokens: int | None = None
) -> int:
    """The K of fixed-K: the best ``K <= max_k`` when every request has the mean confidences.

    Per draft position, the mean confidence over the requests that have that draft; each
    request is modelled with those means (its survival their cumulative product) and
    ``min(K, n_r)`` drafts; the K of highest throughput wins (the smallest among ties), among
    those whose batch fits ``max_tokens``.
    """
    c, mask = _padded(conf)
    return _fixed_k(c, mask, profile, max_k, max_tokens)


def _fixed_k(
    c: FloatArray, mask: npt.NDArray[np.bool_], profile: StepProfile, max_k: int, max_tokens: int | None
) -> int:
    batch, kmax = c.shape
    if batch == 0 or kmax == 0:
        return 0
    n = mask.sum(axis=1)
    mean_c = (c * mask).sum(axis=0) / np.maximum(mask.sum(axis=0), 1)
    cum = np.concatenate([[0.0], np.cumsum(np.cumprod(mean_c))])
    ks = np.arange(min(max_k, kmax) + 1)
    kr = np.minimum(n[None, :], ks[:, None])  # [K + 1, B]: drafts each request verifies at each K
    tokens = batch + kr.sum(axis=1)
    thr = (1.0 + cum[kr]).sum(axis=1) * profile.steps_per_s(tokens)
    if max_tokens is not None:  # K = 0 always fits: every request's own token is verified
        thr[1:][tokens[1:] > max_tokens] = -1.0
    return int(np.argmax(thr))  # the smallest K among ties


def choose_policy(
    conf: Confidences,
    profile: StepProfile,
    max_k: int = 5,
    *,
    margin: float = 0.01,
    dspark_overhead_s: float = 0.0,
    max_tokens: int | None = None,
    plan: DSparkPlan | None = None,
) -> tuple[list[int], str]:
    """DSpark selection or fixed-K, whichever the expected-throughput model predicts higher.

    Fixed-K takes ``K`` from :func:`fixed_k_from_means` (the draft length "from the same
    profile", with mean confidences) and verifies ``min(K, n_r)`` drafts of every request.
    Both candidates are then scored by the same per-request expected model; DSpark's step
    time carries ``dspark_overhead_s`` extra seconds (confidence head and selection; 0 by
    default). DSpark is chosen only if it beats fixed-K by more than ``margin`` (relative):
    with calibrated confidences and no overhead DSpark is never worse, since fixed-K is one
    of the choices it optimises over, so the margin is what keeps the uniform "verify every
    draft" batch where selection does not pay (cheap tokens: both verify nearly everything).

    ``plan``: `plan_dspark`'s result for these confidences (cut to ``max_k``) and this
    profile, where the caller has it (taken when it fits ``max_tokens``: the capped plan is
    then the same). With one request the selection is fixed-K's choice (its survivals fall
    with the draft position, so the greedy order is the positional one and both maximise
    the same throughput over the same prefixes), so only one of the two is made.

    Returns ``(ks, name)``, ``name`` in {"dspark", "fixed-K", "none"} ("none" whenever the
    chosen ``ks`` are all zero).
    """
    if max_k < 0:
        raise ValueError("max_k must be >= 0")
    if plan is not None and max_tokens is not None and plan.tokens > max_tokens:
        plan = None  # made without the cap, which binds: not this step's plan
    rows: Any = conf
    if len(rows) == 1:  # the selection is fixed-K's (above)
        if plan is None:
            plan = _plan_one(rows[0][:max_k], profile, max_tokens, "argmax")
        ks1 = int(plan.ks[0])
        return [ks1], ("fixed-K" if ks1 else "none")
    c, mask = _padded(conf)
    if c.shape[0] == 0:
        return [], "none"
    c, mask = c[:, :max_k], mask[:, :max_k]
    a = _cumprod(c)
    k_fixed = _fixed_k(c, mask, profile, max_k, max_tokens)
    ks_fixed = np.minimum(mask.sum(axis=1), k_fixed).astype(np.int64)
    thr_fixed = throughput(_expected(a, mask, ks_fixed), float((ks_fixed + 1).sum()), profile)
    if plan is None:
        plan = _plan(a, mask, profile, max_tokens, "argmax")
    thr_dspark = plan.expected_accepted / (float(profile.seconds(plan.tokens)) + dspark_overhead_s)
    if thr_dspark > thr_fixed * (1.0 + margin):
        ks, name = plan.ks, "dspark"
    else:
        ks, name = ks_fixed, "fixed-K"
    if not np.any(ks):
        name = "none"
    return ks.tolist(), name
