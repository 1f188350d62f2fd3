"""Prefill length tiers: engines assigned in proportion to each tier's compute demand.

DeepSeek groups prefill requests by total context length into four tiers (<16K, 16-64K,
64-256K, >=256K) and gives each tier a share of the prefill engines proportional to that
tier's share of compute demand in the previous round (DeepSeek's published design; docs/router.md).

Rules, in order:

* **Demand.** ``record(tier, seconds)`` adds the predicted prefill seconds (cost model,
  after cache hits) of every routed request to the current round's tier total.
* **Target.** At a round boundary, ``target_i = N * demand_i / sum(demand)`` (fractional).
* **Hysteresis.** The current allocation ``n_i`` is kept unless some tier is out of band:
  ``|n_i - target_i| > 0.5 + hysteresis`` or a tier with demand has no engine. Rounding
  alone therefore never moves an engine, and a tier hovering at a boundary does not flap.
* **Apportion.** When re-planning, counts come from largest remainders, every tier with
  demand getting at least one engine while engines last.
* **Which engines move.** Surplus tiers give up the engines with the least outstanding work
  that have not moved within ``min_dwell_rounds``; deficit tiers take them, least loaded
  first. Engines that stay keep their caches warm for their tier.
* Before the first round ends there is no history: every engine serves every tier.
* A request whose tier has no engine goes to the nearest tier that has some, longer first.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

DEFAULT_BOUNDARIES = (16_384, 65_536, 262_144)


@dataclass(frozen=True)
class TierConfig:
    boundaries: tuple[int, ...] = DEFAULT_BOUNDARIES  # tier i holds lengths < boundaries[i]
    round_s: float = 10.0
    hysteresis: float = 0.25  # extra engines of tolerated deviation beyond rounding (0.5)
    min_dwell_rounds: int = 2

    def __post_init__(self) -> None:
        b = self.boundaries
        if not b or any(x <= 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"TierConfig.boundaries must be positive and strictly increasing, got {b}")
        if self.round_s <= 0:
            raise ValueError(f"TierConfig.round_s must be > 0 seconds, got {self.round_s}")
        if self.hysteresis < 0:
            raise ValueError(f"TierConfig.hysteresis must be >= 0, got {self.hysteresis}")
        if self.min_dwell_rounds < 0:
            raise ValueError(f"TierConfig.min_dwell_rounds must be >= 0, got {self.min_dwell_rounds}")

    @property
    def num_tiers(self) -> int:
        return len(self.boundaries) + 1


def apportion(demand: np.ndarray, num_engines: int) -> np.ndarray:
    """Largest-remainder split of ``num_engines`` by ``demand``; tiers with demand get >= 1."""
    demand = np.asarray(demand, dtype=np.float64)
    counts = np.zeros(len(demand), dtype=np.int64)
    total = demand.sum()
    if total <= 0:
        return counts
    active = np.flatnonzero(demand > 0)
    # seed one engine per active tier, biggest demand first, while engines last
    for t in active[np.argsort(-demand[active], kind="stable")][:num_engines]:
        counts[t] = 1
    left = num_engines - int(counts.sum())
    if left <= 0:
        return counts
    target = num_engines * demand / total
    extra = np.maximum(target - counts, 0.0)
    if extra.sum() <= 0:
        extra = demand.copy()
    share = left * extra / extra.sum()
    add = np.floor(share).astype(np.int64)
    rem = share - add
    order = np.argsort(-rem, kind="stable")
    for t in order[: left - int(add.sum())]:
        add[t] += 1
    return counts + add


class TierPlanner:
    """Owns the engine -> tier map; pure, driven by ``record`` and ``maybe_rebalance``."""

    def __init__(self, config: TierConfig, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"TierPlanner needs >= 1 engine, got {num_engines}")
        self.config = config
        self.num_engines = num_engines
        self.engine_tier = np.full(num_engines, -1, dtype=np.int64)  # -1: serves every tier
        self._moved_round = np.full(num_engines, -(10**9), dtype=np.int64)
        self._demand = np.zeros(config.num_tiers, dtype=np.float64)
        self._round = 0
        self._round_end: float | None = None
        self.last_demand = np.zeros(config.num_tiers, dtype=np.float64)
        self.moves = 0  # engines re-assigned so far (thrash indicator)
        self._masks: list[np.ndarray] | None = None
        self._mask_lists: list[list[bool]] | None = None

    def tier_of(self, input_len: int) -> int:
        return bisect.bisect_right(self.config.boundaries, input_len)

    def record(self, tier: int, work_s: float) -> None:
        self._demand[tier] += max(work_s, 0.0)

    def maybe_rebalance(self, now_s: float, engine_work: np.ndarray) -> bool:
        """Close the round if ``now_s`` passed its end; returns True when engines moved."""
        if self._round_end is None:
            self._round_end = now_s + self.config.round_s
            return False
        if now_s < self._round_end:
            return False
        skipped = int((now_s - self._round_end) // self.config.round_s)
        self._round_end += (skipped + 1) * self.config.round_s
        self._round += 1
        demand, self._demand = self._demand, np.zeros_like(self._demand)
        if demand.sum() <= 0:
            return False
        self.last_demand = demand
        self._masks = None
        self._mask_lists = None
        return self._replan(demand, np.asarray(engine_work, dtype=np.float64))

    def engines_of(self, tier: int) -> np.ndarray:
        if np.all(self.engine_tier < 0):
            return np.arange(self.num_engines)
        return np.flatnonzero(self.engine_tier == tier)

    def serving_mask(self, tier: int) -> np.ndarray:
        """Boolean ``[num_engines]``: engines that serve ``tier`` (cached until the next move)."""
        if self._masks is None:
            self._masks = []
            for t in range(self.config.num_tiers):
                m = np.zeros(self.num_engines, dtype=bool)
                m[self.serving_engines(t)] = True
                self._masks.append(m)
        return self._masks[tier]

    def serving_list(self, tier: int) -> list[bool]:
        """``serving_mask`` as a plain list, for per-decision hot paths."""
        if self._mask_lists is None:
            self._mask_lists = [self.serving_mask(t).tolist() for t in range(self.config.num_tiers)]
        return self._mask_lists[tier]

    def serving_engines(self, tier: int) -> np.ndarray:
        """Engines for ``tier``, else the nearest tier that has engines (longer tiers first)."""
        nt = self.config.num_tiers
        for dist in range(nt):
            for t in (tier + dist, tier - dist):
                if 0 <= t < nt:
                    e = self.engines_of(t)
                    if len(e):
                        return e
        return np.arange(self.num_engines)

    def counts(self) -> np.ndarray:
        nt = self.config.num_tiers
        return np.bincount(self.engine_tier[self.engine_tier >= 0], minlength=nt)[:nt]

    def _replan(self, demand: np.ndarray, engine_work: np.ndarray) -> bool:
        n = self.num_engines
        target = n * demand / demand.sum()
        current = self.counts()
        unassigned = bool(np.any(self.engine_tier < 0))
        starved = np.any((demand > 0) & (current == 0))
        out_of_band = np.any(np.abs(current - target) > 0.5 + self.config.hysteresis)
        if not (unassigned or starved or out_of_band):
            return False
        want = apportion(demand, n)
        if unassigned:
            order = np.argsort(engine_work, kind="stable")
            tiers = np.repeat(np.arange(len(want)), want)
            self.engine_tier[order] = tiers
            self._moved_round[:] = self._round
            return True
        return self._move(current, want, engine_work, bool(starved))

    def _move(self, current: np.ndarray, want: np.ndarray, engine_work: np.ndarray, starved: bool) -> bool:
        """Move engines from surplus to deficit tiers; engines inside their dwell time stay
        put unless a tier with demand has no engine at all."""
        dwell_ok = (self._round - self._moved_round) >= self.config.min_dwell_rounds
        released: list[int] = []
        for t in np.flatnonzero(current > want):
            members = np.flatnonzero(self.engine_tier == t)
            if not starved:
                members = members[dwell_ok[members]]
            key = np.lexsort((engine_work[members], ~dwell_ok[members]))  # movable, then idle first
            released.extend(int(e) for e in members[key][: int(current[t] - want[t])])
        released.sort(key=lambda e: (float(engine_work[e]), e))
        deficit = want - current
        moved = 0
        # starved tiers first, then the largest deficit
        for t in sorted(np.flatnonzero(deficit > 0), key=lambda t: (current[t] > 0, -deficit[t], t)):
            for _ in range(int(deficit[t])):
                if not released:
                    break
                e = released.pop(0)
                self.engine_tier[e] = t
                self._moved_round[e] = self._round
                moved += 1
        self.moves += moved
        return moved > 0
