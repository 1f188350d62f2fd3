"""Synthetic expert loads: Zipf-like popularity whose hot set drifts over time.

Model, per layer ``l`` and step ``t`` (all parameters in :class:`LoadGenConfig`):

1. A latent score ``u[l, e](t)`` per expert drifts smoothly: the sum of two random
   rotations, ``(cos(w1 t) a1 + sin(w1 t) b1 + cos(w2 t) a2 + sin(w2 t) b2) / sqrt(2)``
   with ``a, b ~ N(0, 1)`` per expert, ``w1 = 2 pi / drift_period_steps`` and
   ``w2 = w1 / golden ratio`` (never periodic). ``u`` is N(0, 1) at every step; the hot
   set (highest scores) turns over on the scale of ``drift_period_steps``, and the load of
   an expert changes by about ``1.7 * skew * w1 * d`` (relative) over ``d`` steps.
2. Popularity is Zipf over a continuous rank: ``rank = E * sigmoid(-1.702 u)`` (the
   logistic approximation of the expected rank of ``u`` among E normal scores) and
   ``w = (1 + rank) ** -skew_l``. A layer's skew is ``skew * (1 + layer_spread * v_l)``
   with ``v_l`` uniform in [-1, 1], fixed per seed (per-layer variation).
3. Per-step burstiness (a batch drawn from few sequences): ``w *= lognormal(burst_sigma)``
   independently per step and expert.
4. ``p = w / sum(w)`` capped at ``1 / top_k`` (an expert cannot be picked twice by one
   token), and the step's ``tokens_per_step * top_k`` assignments are drawn multinomially.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoadGenConfig:
    num_experts: int = 256
    num_layers: int = 8
    top_k: int = 6
    tokens_per_step: int = 4096  # over the whole EP group
    skew: float = 0.8
    layer_spread: float = 0.3
    drift_period_steps: float = 40000.0
    burst_sigma: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.num_layers < 1 or self.tokens_per_step < 1:
            raise ValueError("num_experts, num_layers and tokens_per_step must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")
        if self.skew < 0 or not 0 <= self.layer_spread < 1:
            raise ValueError("skew must be >= 0 and layer_spread in [0, 1)")
        if self.drift_period_steps <= 0 or self.burst_sigma < 0:
            raise ValueError("drift_period_steps must be > 0 and burst_sigma >= 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DriftingZipfLoads:
    """A load source: ``counts(steps)`` at any step indices, deterministic in
    ``config.seed`` and the order of calls (the burst and sampling noise are drawn per
    call; the drift itself is a fixed function of the step)."""

    def __init__(self, config: LoadGenConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        c = config
        v = self._rng.uniform(-1.0, 1.0, size=c.num_layers)
        self.layer_skew = c.skew * (1.0 + c.layer_spread * v)  # [L]
        self._ab = self._rng.standard_normal((4, c.num_layers, c.num_experts))  # a1 b1 a2 b2
        w1 = 2.0 * np.pi / c.drift_period_steps
        self._omega = (w1, w1 / _GOLDEN)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def popularity(self, steps: np.ndarray) -> np.ndarray:
        """[S, L, E] expected popularity (before burst and sampling noise) at ``steps``."""
        t = np.asarray(steps, dtype=np.float64)[:, None, None]  # [S, 1, 1]
        a1, b1, a2, b2 = self._ab
        w1, w2 = self._omega
        u = (np.cos(w1 * t) * a1 + np.sin(w1 * t) * b1 + np.cos(w2 * t) * a2 + np.sin(w2 * t) * b2) / np.sqrt(
            2.0
        )  # [S, L, E]
        rank = self.config.num_experts / (1.0 + np.exp(1.702 * u))
        w = (1.0 + rank) ** -self.layer_skew[None, :, None]
        return w / w.sum(-1, keepdims=True)

    def counts(self, steps: np.ndarray) -> np.ndarray:
        """Token counts [len(steps), L, E] (int64) at ``steps``."""
        c = self.config
        p = self.popularity(np.asarray(steps, dtype=np.int64))
        if c.burst_sigma:
            p = p * np.exp(c.burst_sigma * self._rng.standard_normal(p.shape))
            p /= p.sum(-1, keepdims=True)
        p = _cap(p, 1.0 / c.top_k)
        return self._rng.multinomial(c.tokens_per_step * c.top_k, p).astype(np.int64)


_GOLDEN = (1.0 + 5.0**0.5) / 2.0


def _cap(p: np.ndarray, cap: float, rounds: int = 4) -> np.ndarray:
    """Clip probabilities at ``cap`` and renormalise (a few rounds converge)."""
    for _ in range(rounds):
        if (p <= cap).all():
            break
        p = np.minimum(p, cap)
        p = p / p.sum(-1, keepdims=True)
    return p
