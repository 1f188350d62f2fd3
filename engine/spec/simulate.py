"""Evaluate speculation policies without a model: synthetic drafts, true outcomes, a profile.

Synthetic model (:class:`SyntheticConfig`, every number a parameter; the defaults are
arbitrary illustrations, not anyone's measurements):

* ``B`` request slots run for ``S`` steps; each step a slot's request finishes with
  probability ``finish_prob`` and a fresh request takes the slot (concurrency stays ``B``).
* Each request draws a base acceptance rate ``p_r ~ Beta(alpha, beta)``.
* Each step it has a difficulty ``z_{r,t}``, an AR(1) process in logit space:
  ``z_t = rho * z_{t-1} + sqrt(1 - rho^2) * sigma_step * eps`` (``z_0 ~ N(0, sigma_step^2)``).
* The true conditional acceptance probability of draft ``j`` (1-based) is
  ``q(r, j, t) = sigmoid(logit(p_r * decay^(j-1)) + z_{r,t})``; draft ``j`` is accepted
  (given ``1..j-1`` were) with probability ``q``: the accepted length ``L`` is the number of
  leading successes of independent Bernoulli(``q``) trials over the ``max_drafts`` drafts.
* The confidence head reports ``c = sigmoid(logit(q) + sigma_conf * eps)``: calibrated
  (``c = q``) at ``sigma_conf = 0``, noisier above.

Every policy sees the same trace (common random numbers). For a step with choice ``{k_r}``
the verification batch has ``T = sum (k_r + 1)`` tokens, the accepted tokens are
``sum (1 + min(k_r, L_r))``, and the step takes ``profile.seconds(T)``. Reported per policy:
verified tokens per step (``T``), accepted length (mean accepted tokens per request per
step), throughput (accepted tokens / simulated seconds) and the mean per-step throughput.

Policies: "none", "fixed-K" (K = 1..max_drafts), "dspark" (current confidences),
"dspark-async" (confidences two steps old, :class:`LaggedConfidence`), "auto"
(:func:`choose_policy`), "oracle" (``k_r = L_r``) and "hindsight" (DSpark on 0/1
confidences from the true outcomes: the best per-step throughput any choice can reach).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine.spec.dspark import choose_policy, plan_dspark, select_fixed, select_oracle
from engine.spec.lagged import LaggedConfidence
from engine.spec.step_table import StepProfile


@dataclass(frozen=True)
class SyntheticConfig:
    batch: int = 16
    steps: int = 200
    max_drafts: int = 5
    alpha: float = 4.0  # Beta(alpha, beta) base acceptance per request
    beta: float = 2.0
    decay: float = 0.9  # per-position decay of the base rate
    sigma_step: float = 1.0  # per-step difficulty (logit) spread
    rho: float = 0.7  # its step-to-step correlation
    sigma_conf: float = 0.5  # confidence-head noise (logit); 0 = calibrated
    finish_prob: float = 0.02
    seed: int = 0


@dataclass(frozen=True)
class Trace:
    """conf [S, B, K] confidences, accepted [S, B] true accepted lengths, rid [S, B] request ids."""

    conf: npt.NDArray[np.float64]
    accepted: npt.NDArray[np.int64]
    rid: npt.NDArray[np.int64]


def _sigmoid(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.asarray(1.0 / (1.0 + np.exp(-x)), dtype=np.float64)


def _logit(p: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.asarray(np.log(p) - np.log1p(-p), dtype=np.float64)


def generate(cfg: SyntheticConfig) -> Trace:
    """A seeded synthetic trace (see the module doc for the model)."""
    rng = np.random.default_rng(cfg.seed)
    s, b, k = cfg.steps, cfg.batch, cfg.max_drafts
    pos_decay = cfg.decay ** np.arange(k)
    base = rng.beta(cfg.alpha, cfg.beta, size=b)
    z = rng.normal(0.0, cfg.sigma_step, size=b)
    rid = np.arange(b, dtype=np.int64)
    next_id = b
    innov = np.sqrt(max(0.0, 1.0 - cfg.rho**2)) * cfg.sigma_step
    conf = np.empty((s, b, k))
    accepted = np.empty((s, b), dtype=np.int64)
    rids = np.empty((s, b), dtype=np.int64)
    for t in range(s):
        if t:
            done = rng.random(b) < cfg.finish_prob
            nd = int(done.sum())
            if nd:
                base[done] = rng.beta(cfg.alpha, cfg.beta, size=nd)
                z[done] = rng.normal(0.0, cfg.sigma_step, size=nd)
                rid[done] = np.arange(next_id, next_id + nd)
                next_id += nd
            z = np.where(done, z, cfg.rho * z + innov * rng.normal(size=b))
        logit_q = _logit(base[:, None] * pos_decay[None, :]) + z[:, None]
        q = _sigmoid(logit_q)
        ok = rng.random((b, k)) < q
        accepted[t] = np.cumprod(ok, axis=1).sum(axis=1)
        conf[t] = _sigmoid(logit_q + cfg.sigma_conf * rng.normal(size=(b, k)))
        rids[t] = rid
    return Trace(conf, accepted, rids)


@dataclass
class PolicyResult:
    name: str
    verified_per_step: float  # mean T
    accepted_length: float  # mean accepted tokens per request per step
    throughput: float  # accepted tokens / simulated seconds
    step_throughput: float  # mean over steps of accepted * steps_per_s(T)
    verified_per_accepted: float
    choices: dict[str, int] = field(default_factory=dict)  # "auto": steps per chosen policy


Chooser = Callable[[int, npt.NDArray[np.float64]], tuple[npt.ArrayLike, str | None]]


def _run(name: str, trace: Trace, profile: StepProfile, choose: Chooser) -> PolicyResult:
    steps, batch, _ = trace.conf.shape
    tokens = np.empty(steps)
    acc = np.empty(steps)
    chosen: Counter[str] = Counter()
    for t in range(steps):
        ks, label = choose(t, trace.conf[t])
        k = np.asarray(ks, dtype=np.int64)
        tokens[t] = float((k + 1).sum())
        acc[t] = float((1 + np.minimum(k, trace.accepted[t])).sum())
        if label is not None:
            chosen[label] += 1
    secs = profile.seconds(tokens)
    return PolicyResult(
        name=name,
        verified_per_step=float(tokens.mean()),
        accepted_length=float(acc.sum() / (steps * batch)),
        throughput=float(acc.sum() / secs.sum()),
        step_throughput=float((acc / secs).mean()),
        verified_per_accepted=float(tokens.sum() / acc.sum()),
        choices=dict(chosen),
    )


def _async_chooser(trace: Trace, profile: StepProfile, lag: int) -> Chooser:
    lagged = LaggedConfidence(lag=lag)
    k = trace.conf.shape[2]

    def choose(t: int, conf: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        rids = trace.rid[t]
        if t:
            for r in set(trace.rid[t - 1].tolist()) - set(rids.tolist()):
                lagged.drop(r)
        stale = np.stack([lagged.get(int(r), k) for r in rids])
        ks = plan_dspark(stale, profile).ks
        for r, c in zip(rids, conf):
            lagged.record(int(r), c)
        return ks, None

    return choose


def simulate(
    trace: Trace,
    profile: StepProfile,
    policies: Sequence[str] | None = None,
    *,
    auto_margin: float = 0.01,
) -> list[PolicyResult]:
    """Run each named policy over the same trace (default: all of them)."""
    k = trace.conf.shape[2]
    names = list(policies) if policies is not None else default_policies(k)
    return [_run(name, trace, profile, _chooser(name, trace, profile, auto_margin)) for name in names]


def _chooser(name: str, trace: Trace, profile: StepProfile, auto_margin: float) -> Chooser:
    k = trace.conf.shape[2]
    ar = np.arange(k)

    def none(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        return np.zeros(c.shape[0], dtype=np.int64), None

    def fixed(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        return select_fixed([c.shape[1]] * c.shape[0], int(name.removeprefix("fixed-"))), None

    def dspark(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        return plan_dspark(c, profile).ks, None

    def auto(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        return choose_policy(c, profile, k, margin=auto_margin)

    def oracle(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        return select_oracle(trace.accepted[t]), None

    def hindsight(t: int, c: npt.NDArray[np.float64]) -> tuple[npt.ArrayLike, str | None]:
        truth = (ar[None, :] < trace.accepted[t][:, None]).astype(np.float64)
        return plan_dspark(truth, profile).ks, None

    if name.startswith("fixed-") and name.removeprefix("fixed-").isdigit():
        return fixed
    if name == "dspark-async":
        return _async_chooser(trace, profile, lag=2)
    table: dict[str, Chooser] = {
        "none": none,
        "dspark": dspark,
        "auto": auto,
        "oracle": oracle,
        "hindsight": hindsight,
    }
    if name not in table:
        raise ValueError(f"unknown policy {name!r}")
    return table[name]


def default_policies(max_drafts: int) -> list[str]:
    return [
        "none",
        *(f"fixed-{k}" for k in range(1, max_drafts + 1)),
        "dspark",
        "dspark-async",
        "auto",
        "oracle",
        "hindsight",
    ]


def roofline_seconds(floor_s: float, knee_tokens: float, per_token_s: float) -> Callable[[float], float]:
    """An illustrative step-time shape: flat (memory-bound) up to a knee, then linear.

    ``seconds(T) = floor_s + per_token_s * max(0, T - knee_tokens)``. For trying the
    simulator only; real runs use a measured :class:`StepProfile`.
    """

    def seconds(tokens: float) -> float:
        return floor_s + per_token_s * max(0.0, float(tokens) - knee_tokens)

    return seconds


def format_table(rows_by_batch: dict[int, list[PolicyResult]]) -> str:
    """Markdown table: one row per (B, policy)."""
    lines = [
        "| B | policy | verified tok/step | accepted len | throughput tok/s | verified/accepted |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for b, rows in rows_by_batch.items():
        for r in rows:
            extra = f" {r.choices}" if r.choices else ""
            lines.append(
                f"| {b} | {r.name}{extra} | {r.verified_per_step:.1f} | {r.accepted_length:.3f} "
                f"| {r.throughput:,.0f} | {r.verified_per_accepted:.3f} |"
            )
    return "\n".join(lines)
