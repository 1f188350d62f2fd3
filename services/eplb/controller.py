"""EPLB controller core for one EP group (pure policy; no torch, no Ray, no sockets).

Cycle, driven by engine steps:
1. ``due(step)``: a window has been seen and the period has elapsed since the last
   decision, and no remap is in flight.
2. ``decide(step, rank_windows)``: sum the per-rank windows (each rank counts the tokens
   it dispatched), compute a placement with the configured algorithm, and return a
   :class:`Decision` holding, per layer that changes, the new phy2log and the weight-move
   plan. Layers whose window imbalance would not improve by ``min_gain`` stay as they are.
3. The ranks move weights layer by layer (``layers_per_step`` per engine step); old weights
   serve until a layer's new ones are in place, then the engine switches that layer's
   replica tables and reports ``commit_layer(layer)``. The next decision waits for the
   last commit.

Every rank may run its own controller on the same all-reduced window: the algorithms are
deterministic, so all ranks reach the same decision without a coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from router.eplb.metric import imbalance_matrix
from router.eplb.placement import (
    Placement,
    PlacementSpec,
    available_algorithms,
    compute_placement,
    identity_placement,
)
from router.eplb.transfer import RemapPlan, plan_remap

if TYPE_CHECKING:  # pydantic stays out of the engine ranks' imports (GPU hosts may lack it)
    from services.ray.cluster_spec import EplbSpec

_POOL_DEFAULTS: dict[str, dict[str, int]] = {
    # DeepSeek's published settings (docs/eplb.md)
    "prefill": {"num_redundant_per_rank": 4, "window_steps": 100, "period_steps": 1000},
    "decode": {"num_redundant_per_rank": 1, "window_steps": 1000, "period_steps": 10000},
}


@dataclass(frozen=True)
class EplbConfig:
    """EPLB settings of one pool (the cluster spec's ``pools.<pool>.eplb`` section).

    ``first_step`` (default: ``window_steps``) is the first step a decision may happen;
    ``min_gain`` is the least drop in a layer's window imbalance (max/mean) worth moving
    that layer's weights for; ``layers_per_step`` paces the move.
    """

    pool: str
    num_redundant_per_rank: int
    window_steps: int
    period_steps: int
    enabled: bool = True
    algorithm: str = "waterfill_sticky"
    num_groups: int = 1
    gpus_per_node: int = 8
    first_step: int | None = None
    min_gain: float = 0.0
    layers_per_step: int = 1

    def __post_init__(self) -> None:
        if self.pool not in _POOL_DEFAULTS:
            raise ValueError(f"eplb.pool must be one of {sorted(_POOL_DEFAULTS)}, got {self.pool!r}")
        if self.num_redundant_per_rank < 0:
            raise ValueError(f"eplb.num_redundant_per_rank must be >= 0, got {self.num_redundant_per_rank}")
        if self.window_steps < 1 or self.period_steps < self.window_steps:
            raise ValueError(
                f"eplb needs 1 <= window_steps <= period_steps, got window {self.window_steps}, "
                f"period {self.period_steps}"
            )
        if self.algorithm not in available_algorithms():
            raise ValueError(
                f"eplb.algorithm {self.algorithm!r} is unknown; known: {', '.join(available_algorithms())}"
            )
        if self.num_groups < 1 or self.gpus_per_node < 1 or self.layers_per_step < 1:
            raise ValueError("eplb.num_groups, gpus_per_node and layers_per_step must be >= 1")
        if self.first_step is not None and self.first_step < self.window_steps:
            raise ValueError(
                f"eplb.first_step ({self.first_step}) must be >= window_steps ({self.window_steps})"
            )
        if self.min_gain < 0:
            raise ValueError(f"eplb.min_gain must be >= 0, got {self.min_gain}")

    @classmethod
    def for_pool(cls, pool: str, **overrides: Any) -> EplbConfig:
        """DeepSeek's defaults for ``pool`` with ``overrides`` applied."""
        if pool not in _POOL_DEFAULTS:
            raise ValueError(f"eplb pool must be one of {sorted(_POOL_DEFAULTS)}, got {pool!r}")
        return cls(pool=pool, **{**_POOL_DEFAULTS[pool], **overrides})

    @classmethod
    def from_mapping(cls, pool: str, section: Mapping[str, Any]) -> EplbConfig:
        """From a cluster-spec section; unknown keys are rejected, not ignored."""
        known = {f.name for f in fields(cls)} - {"pool"}
        unknown = set(section) - known
        if unknown:
            raise ValueError(f"unknown eplb setting(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls.for_pool(pool, **dict(section))

    @classmethod
    def from_cluster_spec(cls, pool: str, spec: EplbSpec, **extra: Any) -> EplbConfig:
        """From the cluster spec's ``<pool>.eplb`` section (``services.ray.cluster_spec``);
        ``extra`` overrides any field."""
        fields: dict[str, Any] = {
            "enabled": spec.enabled,
            "num_redundant_per_rank": spec.redundant_experts_per_gpu,
            "window_steps": spec.window_steps,
            "period_steps": spec.period_steps,
            "algorithm": spec.algorithm,
            "min_gain": spec.min_gain,
            "layers_per_step": spec.layers_per_step,
            "num_groups": spec.num_groups,
            "gpus_per_node": spec.gpus_per_node,
        }
        return cls.for_pool(pool, **{**fields, **extra})

    def spec(self, num_logical: int, num_ranks: int) -> PlacementSpec:
        nodes = max(1, num_ranks // self.gpus_per_node) if num_ranks % self.gpus_per_node == 0 else 1
        return PlacementSpec(num_logical, num_ranks, self.num_redundant_per_rank, nodes, self.num_groups)


@dataclass(frozen=True)
class LayerRemap:
    layer: int
    new_phy2log: np.ndarray  # [n_phys]
    plan: RemapPlan
    window_imbalance_before: float
    window_imbalance_after: float


@dataclass(frozen=True)
class Decision:
    step: int
    layers: tuple[LayerRemap, ...]  # only layers that change, in layer order
    layers_per_step: int

    def batches(self) -> list[tuple[LayerRemap, ...]]:
        """The layers to move at each successive engine step."""
        k = self.layers_per_step
        return [self.layers[i : i + k] for i in range(0, len(self.layers), k)]


class EplbController:
    """Pure controller for one EP group; see the module docstring for the cycle."""

    def __init__(
        self,
        config: EplbConfig,
        num_layers: int,
        num_logical: int,
        num_ranks: int,
        initial: Placement | None = None,
    ) -> None:
        self.config = config
        self.spec = config.spec(num_logical, num_ranks)
        self.num_layers = num_layers
        if initial is None:
            initial = _initial_placement(num_layers, self.spec)
        if initial.phy2log.shape != (num_layers, self.spec.num_physical):
            raise ValueError(f"initial placement must be [{num_layers}, {self.spec.num_physical}]")
        self.placement = initial
        self._next_due = config.first_step if config.first_step is not None else config.window_steps
        self._pending: set[int] = set()
        self._pending_rows: dict[int, np.ndarray] = {}
        # the last decision's window imbalance (mean over layers): under the placement that
        # served the window, and under the one computed from it (None before any decision)
        self.last_imbalance: tuple[float, float] | None = None

    @property
    def remap_in_flight(self) -> bool:
        return bool(self._pending)

    def due(self, step: int) -> bool:
        return self.config.enabled and not self._pending and step >= self._next_due

    def window_load(self, rank_windows: Sequence[np.ndarray]) -> np.ndarray:
        """Sum per-rank windows (each [n_steps, L, E] or [L, E]) over ranks and steps."""
        if not rank_windows:
            raise ValueError("no rank windows to decide from")
        want = (self.num_layers, self.spec.num_logical)
        total = np.zeros(want, dtype=np.float64)
        for i, w in enumerate(rank_windows):
            w = np.asarray(w)
            w = w[-self.config.window_steps :].sum(0) if w.ndim == 3 else w
            if w.shape != want:
                raise ValueError(
                    f"rank window {i} has shape {w.shape}, expected [steps, {want[0]}, {want[1]}]"
                )
            total += w
        return total

    def decide(self, step: int, rank_windows: Sequence[np.ndarray]) -> Decision:
        """Compute the next placement from the windows and plan its weight moves."""
        if self._pending:
            raise ValueError(f"layers {sorted(self._pending)} of the previous decision are not committed yet")
        load = self.window_load(rank_windows)
        new = compute_placement(self.config.algorithm, load, self.spec, previous=self.placement)
        before = _window_imbalance(load, self.placement)
        after = _window_imbalance(load, new)
        self.last_imbalance = (float(before.mean()), float(after.mean()))
        layers = []
        for layer in range(self.num_layers):
            old_row, new_row = self.placement.phy2log[layer], new.phy2log[layer]
            if np.array_equal(old_row, new_row) or before[layer] - after[layer] < max(
                self.config.min_gain, 1e-12
            ):
                continue
            plan = plan_remap(old_row, new_row, self.spec.num_ranks)
            layers.append(LayerRemap(layer, new_row.copy(), plan, float(before[layer]), float(after[layer])))
        self._next_due = step + self.config.period_steps
        self._pending = {lr.layer for lr in layers}
        self._pending_rows = {lr.layer: lr.new_phy2log for lr in layers}
        return Decision(step, tuple(layers), self.config.layers_per_step)

    def commit_layer(self, layer: int) -> None:
        """The engine has the layer's new weights and tables in place."""
        if layer not in self._pending:
            raise ValueError(f"layer {layer} has no remap in flight")
        rows = self.placement.phy2log.copy()
        rows[layer] = self._pending_rows.pop(layer)
        self._pending.discard(layer)
        self.placement = Placement.from_phy2log(rows, self.spec.num_logical, self.spec.num_ranks)


def _initial_placement(num_layers: int, spec: PlacementSpec) -> Placement:
    """Before any statistics: every rank owns its contiguous experts and fills its redundant
    slots with replicas of its own first experts (no load known, nothing to favour)."""
    base = identity_placement(num_layers, spec.num_logical, spec.num_ranks).phy2log
    per_rank = spec.num_logical // spec.num_ranks
    rows = []
    for r in range(spec.num_ranks):
        own = base[:, r * per_rank : (r + 1) * per_rank]
        rows += [own, own[:, np.arange(spec.num_redundant_per_rank) % per_rank]]
    return Placement.from_phy2log(np.concatenate(rows, axis=1), spec.num_logical, spec.num_ranks)


def _window_imbalance(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[L] max/mean rank load of ``load`` [L, E] under an even split over replicas."""
    per_slot = np.take_along_axis(load, placement.phy2log, 1) / np.take_along_axis(
        placement.logcnt, placement.phy2log, 1
    )
    ranks = per_slot.reshape(load.shape[0], placement.num_ranks, -1).sum(-1)
    out = imbalance_matrix(ranks)
    return np.where(np.isnan(out), 1.0, out)
