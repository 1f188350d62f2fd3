"""Window/period simulation of EPLB on a stream of expert loads (no peeking ahead).

Timeline: steps ``[0, window)`` are warm-up (no policy is evaluated there). Re-placement
happens at ``T_k = window + k * period``; placement ``k`` is computed from the token counts
of steps ``[T_k - window, T_k)`` only and serves steps ``[T_k, T_{k+1})``. Evaluation covers
steps ``[window, total_steps)`` every ``eval_stride``-th step, the same steps for every
policy:

- ``none``: identity placement, no redundant experts (plain EP).
- ``static``: one placement by ``static_algorithm`` at ``T_0`` from the first window,
  never updated.
- ``eplb:<algorithm>``: re-placed at every ``T_k`` by that algorithm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from router.eplb.metric import imbalance_matrix
from router.eplb.placement import Placement, PlacementSpec, compute_placement, identity_placement
from router.eplb.split import rank_loads
from router.eplb.transfer import plan_remap


class LoadSource(Protocol):
    """Token counts per step, layer and logical expert.

    ``counts(steps)`` takes strictly increasing step indices, never earlier than steps
    already asked for, and returns int64 [len(steps), num_layers, num_experts]."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    def counts(self, steps: np.ndarray) -> np.ndarray: ...


class RecordedLoads:
    """A recorded load file: ``.npz`` with ``counts`` [S, L, E] (tokens per step, layer,
    logical expert), as the engine's ``ExpertLoadRecorder`` dumps it."""

    def __init__(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts)
        if counts.ndim != 3 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError("recorded loads must be non-negative integer counts [steps, layers, experts]")
        self._counts = counts.astype(np.int64)
        self.num_steps, self.num_layers, self.num_experts = counts.shape

    @classmethod
    def load(cls, path: str) -> RecordedLoads:
        with np.load(path, allow_pickle=False) as data:
            if "counts" not in data:
                raise ValueError(f"{path}: no 'counts' array (found {sorted(data.files)})")
            return cls(data["counts"])

    def counts(self, steps: np.ndarray) -> np.ndarray:
        return self._counts[np.asarray(steps, dtype=np.int64)]


@dataclass(frozen=True)
class SimConfig:
    spec: PlacementSpec
    window: int
    period: int
    total_steps: int
    algorithms: tuple[str, ...]
    static_algorithm: str
    eval_stride: int = 1
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.window < 1 or self.period < 1 or self.eval_stride < 1 or self.chunk < 1:
            raise ValueError("window, period, eval_stride and chunk must be >= 1")
        if self.window > self.period:
            raise ValueError(f"window ({self.window}) longer than period ({self.period}) is not supported")
        if self.total_steps <= self.window:
            raise ValueError(f"total_steps ({self.total_steps}) must exceed the window ({self.window})")


@dataclass
class SimResult:
    imbalance: dict[str, float]  # policy -> mean over evaluated steps and layers
    per_layer: dict[str, list[float]]
    placements: int
    eval_steps: int
    placement_ms: dict[str, float] = field(default_factory=dict)  # mean wall time per call
    # per re-placement after the first: share of physical slots that receive weights over
    # the network (router.eplb.transfer.plan_remap), mean over layers and re-placements
    moved_fraction: dict[str, float] = field(default_factory=dict)


def _policies(cfg: SimConfig) -> list[str]:
    return ["none", "static", *(f"eplb:{a}" for a in cfg.algorithms)]


def simulate(source: LoadSource, cfg: SimConfig) -> SimResult:
    """Run every policy over the same steps of ``source``; see the module docstring."""
    if source.num_experts != cfg.spec.num_logical:
        raise ValueError(f"load source has {source.num_experts} experts, spec {cfg.spec.num_logical}")
    n_layers = source.num_layers
    rebal = list(range(cfg.window, cfg.total_steps, cfg.period))
    eval_mask = np.zeros(cfg.total_steps, dtype=bool)
    eval_mask[cfg.window :: cfg.eval_stride] = True
    window_mask = np.zeros(cfg.total_steps, dtype=bool)
    for t in rebal:
        window_mask[t - cfg.window : t] = True
    needed = np.flatnonzero(eval_mask | window_mask)

    current: dict[str, Placement] = {
        "none": identity_placement(n_layers, cfg.spec.num_logical, cfg.spec.num_ranks)
    }
    sums = {p: np.zeros(n_layers) for p in _policies(cfg)}
    valid = np.zeros(n_layers)  # evaluated (step, layer) pairs that carry load
    times: dict[str, list[float]] = {a: [] for a in {*cfg.algorithms, cfg.static_algorithm}}
    moved: dict[str, list[float]] = {a: [] for a in cfg.algorithms}
    window_sum = np.zeros((n_layers, cfg.spec.num_logical))
    n_eval = 0
    bounds = [0, *rebal, cfg.total_steps]
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if k >= 1:  # at T_{k-1}: place from the window that just ended
            _replace(current, window_sum, cfg, first=(k == 1), times=times, moved=moved)
            window_sum[:] = 0
        seg = needed[(needed >= lo) & (needed < hi)]
        for start in range(0, seg.size, cfg.chunk):
            steps = seg[start : start + cfg.chunk]
            counts = source.counts(steps)  # [S, L, E]
            wm = window_mask[steps]
            if wm.any():
                window_sum += counts[wm].sum(0)
            em = eval_mask[steps]
            if em.any():
                ev = counts[em]
                n_eval += int(em.sum())
                valid += (ev.sum(-1) > 0).sum(0)
                for policy, placement in current.items():
                    sums[policy] += np.nansum(imbalance_matrix(rank_loads(ev, placement)), axis=0)
    if not valid.any():
        raise ValueError("no evaluated step carries any load")
    per_layer = {p: (s / np.maximum(valid, 1)).tolist() for p, s in sums.items()}
    return SimResult(
        imbalance={p: float(np.mean(v)) for p, v in per_layer.items()},
        per_layer=per_layer,
        placements=len(rebal),
        eval_steps=n_eval,
        placement_ms={a: 1e3 * float(np.mean(v)) for a, v in times.items() if v},
        moved_fraction={a: float(np.mean(v)) for a, v in moved.items() if v},
    )


def _replace(
    current: dict[str, Placement],
    window_sum: np.ndarray,
    cfg: SimConfig,
    first: bool,
    times: dict[str, list[float]],
    moved: dict[str, list[float]],
) -> None:
    cache: dict[str, Placement] = {}
    wanted = list(cfg.algorithms) + ([cfg.static_algorithm] if first else [])
    for alg in wanted:
        if alg not in cache:
            t0 = time.perf_counter()
            cache[alg] = compute_placement(alg, window_sum, cfg.spec, previous=current.get(f"eplb:{alg}"))
            times[alg].append(time.perf_counter() - t0)
    for alg in cfg.algorithms:
        old = current.get(f"eplb:{alg}")
        if old is not None:
            n = sum(
                len(plan_remap(o, n_, cfg.spec.num_ranks).transfers)
                for o, n_ in zip(old.phy2log, cache[alg].phy2log)
            )
            moved[alg].append(n / old.phy2log.size)
        current[f"eplb:{alg}"] = cache[alg]
    if first:
        current["static"] = cache[cfg.static_algorithm]
