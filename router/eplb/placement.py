"""Placement types and the typed registry of placement algorithms.

A *placement* says, for every MoE layer, which logical expert each physical expert slot
holds. Physical slots are numbered rank-major: slot ``p`` lives on rank
``p // slots_per_rank``. Every logical expert has at least one slot; the extra
("redundant") slots hold replicas of hot experts.

An algorithm is a pure function ``(load [L, n_logical], PlacementSpec, previous) ->
Placement`` registered by name with :func:`register_algorithm` (``previous``: the placement
in force, which move-aware algorithms use to keep experts where they are). Algorithms must be deterministic
(same input, same output on every host) because every rank of an EP group may compute
the placement itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Algorithm(Protocol):
    """``load`` [L, n_logical] (tokens over the window, any scale), ``spec``, and the
    placement now in force (``previous``, same spec, or None) -> a new placement.
    Pure and deterministic; algorithms that ignore ``previous`` may."""

    def __call__(
        self, load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None
    ) -> Placement: ...


@dataclass(frozen=True)
class PlacementSpec:
    """The shape of an EP group: what a placement must fit.

    ``num_ranks`` GPUs (EP ranks) on ``num_nodes`` nodes, ``num_redundant_per_rank`` extra
    slots per rank beyond the ``num_logical / num_ranks`` each owns, and ``num_groups``
    expert groups (DeepSeek's group-limited routing; the hierarchical policy keeps a group
    on one node).
    """

    num_logical: int
    num_ranks: int
    num_redundant_per_rank: int
    num_nodes: int = 1
    num_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("num_logical", "num_ranks", "num_nodes", "num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlacementSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant_per_rank < 0:
            raise ValueError(
                f"PlacementSpec.num_redundant_per_rank must be >= 0, got {self.num_redundant_per_rank}"
            )
        if self.num_logical % self.num_ranks:
            raise ValueError(
                f"{self.num_logical} logical experts do not split evenly over {self.num_ranks} ranks; "
                "choose an EP size that divides the expert count"
            )
        if self.num_ranks % self.num_nodes:
            raise ValueError(f"{self.num_ranks} ranks do not split evenly over {self.num_nodes} nodes")
        if self.num_logical % self.num_groups:
            raise ValueError(f"{self.num_logical} experts do not split into {self.num_groups} equal groups")

    @property
    def num_physical(self) -> int:
        return self.num_logical + self.num_ranks * self.num_redundant_per_rank

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes


@dataclass(frozen=True)
class Placement:
    """Per-layer expert placement.

    - ``phy2log`` [L, n_phys]: logical expert held by each physical slot (rank-major).
    - ``replica`` [L, n_phys]: index of that slot among its expert's replicas (0..cnt-1),
      in increasing slot order; the token split (``router.eplb.split``) uses it.
    - ``logcnt`` [L, n_logical]: replica count per logical expert (>= 1).
    - ``log2phy`` [L, n_logical, max_replicas]: physical slots of each expert in replica
      order, padded with -1.
    """

    phy2log: np.ndarray
    replica: np.ndarray
    logcnt: np.ndarray
    log2phy: np.ndarray
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @classmethod
    def from_phy2log(cls, phy2log: np.ndarray, num_logical: int, num_ranks: int) -> Placement:
        """Derive replica indices, counts and log2phy from ``phy2log`` and validate it."""
        phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
        if phy2log.ndim != 2:
            raise ValueError(f"phy2log must be [layers, n_phys], got shape {phy2log.shape}")
        n_layers, n_phys = phy2log.shape
        if n_phys % num_ranks:
            raise ValueError(f"{n_phys} physical slots do not split evenly over {num_ranks} ranks")
        if phy2log.size and (phy2log.min() < 0 or phy2log.max() >= num_logical):
            raise ValueError(f"phy2log holds ids outside [0, {num_logical})")
        logcnt = np.zeros((n_layers, num_logical), dtype=np.int64)
        rows = np.repeat(np.arange(n_layers), n_phys)
        np.add.at(logcnt, (rows, phy2log.ravel()), 1)
        if (logcnt == 0).any():
            layer, expert = np.argwhere(logcnt == 0)[0]
            raise ValueError(f"layer {layer}: logical expert {expert} has no physical slot")
        # replica index = occurrences of the same expert in earlier slots of the layer
        order = np.argsort(phy2log, axis=1, kind="stable")  # [L, P]
        sorted_ids = np.take_along_axis(phy2log, order, axis=1)
        starts = np.cumsum(logcnt, axis=1) - logcnt  # [L, E]
        occ_sorted = np.arange(n_phys)[None, :] - np.take_along_axis(starts, sorted_ids, axis=1)
        replica = np.empty_like(phy2log)
        np.put_along_axis(replica, order, occ_sorted, axis=1)
        max_rep = int(logcnt.max()) if logcnt.size else 1
        log2phy = np.full((n_layers, num_logical, max_rep), -1, dtype=np.int64)
        slots = np.broadcast_to(np.arange(n_phys), phy2log.shape)
        log2phy[rows, phy2log.ravel(), replica.ravel()] = slots.ravel()
        return cls(phy2log=phy2log, replica=replica, logcnt=logcnt, log2phy=log2phy, num_ranks=num_ranks)

    def rank_of_slot(self) -> np.ndarray:
        """[n_phys] rank holding each physical slot."""
        return np.arange(self.num_physical) // self.slots_per_rank


def identity_placement(num_layers: int, num_logical: int, num_ranks: int) -> Placement:
    """No redundancy: expert ``e`` on rank ``e // (num_logical / num_ranks)`` (what EP does
    without a balancer)."""
    phy2log = np.tile(np.arange(num_logical, dtype=np.int64), (num_layers, 1))
    return Placement.from_phy2log(phy2log, num_logical, num_ranks)


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Algorithm] = {}


def register_algorithm(name: str) -> Callable[[Algorithm], Algorithm]:
    """Decorator: register a placement algorithm under ``name`` (unique)."""

    def deco(fn: Algorithm) -> Algorithm:
        if name in _REGISTRY:
            raise ValueError(f"placement algorithm {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def available_algorithms() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown placement algorithm {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def compute_placement(
    name: str, load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None
) -> Placement:
    """Run algorithm ``name`` on a load window summed or averaged to [L, n_logical]."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] != spec.num_logical:
        raise ValueError(f"load must be [layers, {spec.num_logical}], got shape {load.shape}")
    if (load < 0).any() or not np.isfinite(load).all():
        raise ValueError("load must be finite and non-negative")
    if previous is not None and previous.phy2log.shape != (load.shape[0], spec.num_physical):
        raise ValueError(
            f"previous placement has shape {previous.phy2log.shape}, expected {(load.shape[0], spec.num_physical)}"
        )
    placement = get_algorithm(name)(load, spec, previous)
    if placement.phy2log.shape != (load.shape[0], spec.num_physical):
        raise ValueError(f"algorithm {name!r} returned phy2log of shape {placement.phy2log.shape}")
    return placement


def _load_builtin() -> None:
    # built-in algorithms register on import; importing here avoids a cycle at module load
    from router.eplb import deepseek, ours, sticky  # noqa: F401
