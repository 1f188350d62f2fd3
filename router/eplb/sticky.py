"""Move-aware placement: ``waterfill_sticky``.

Re-placing from scratch refills most slots over the network at every period (the bench
measured 47-97% of all slots for both the baseline and ``waterfill_swap``), although the
loads moved little: packing heuristics are not stable under small load changes, and any
relabelling of ranks is as balanced as any other. ``waterfill_sticky`` starts from the
placement in force instead:

1. Replica counts by water-filling on the new window (as ``waterfill_swap``).
2. Keep every slot whose expert keeps its replica count; free surplus replicas (from the
   most loaded ranks), give the freed slots to experts that need more replicas (least
   loaded rank without that expert first).
3. Swap refinement from that layout (``ours.swap_refine``).
4. Also compute the fresh ``waterfill_swap`` placement, relabel its ranks to overlap the
   current placement most (greedy matching on shared experts), and use it only if the
   sticky one's largest rank load on the window is more than ``tolerance`` higher.
Without a previous placement it is ``waterfill_swap``.

``waterfill_sticky`` uses tolerance 0: on the window it is never worse than
``waterfill_swap`` (hence never worse than ``deepseek_global``), and moves fewer slots.
``waterfill_sticky_lazy`` accepts a 0.2% higher window maximum for far fewer moves.
"""

from __future__ import annotations

import numpy as np

from router.eplb.ours import _place_layer, _refined, waterfill_counts, waterfill_swap
from router.eplb.placement import Placement, PlacementSpec, register_algorithm

TOLERANCE = 0.0005  # accepted relative rise of the window's largest rank load


def _rank_loads(row: np.ndarray, item_w: np.ndarray, num_ranks: int) -> np.ndarray:
    loads = np.where(row >= 0, item_w[np.maximum(row, 0)], 0.0)
    return loads.reshape(num_ranks, -1).sum(1)


def adjust_counts(old_row: np.ndarray, cnt: np.ndarray, weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """The old layout with replicas removed/added to reach ``cnt``; other slots stay."""
    row = old_row.copy()
    s = row.size // num_ranks
    per_replica = weight / cnt  # [E] load of one replica under the new counts
    have = np.bincount(row, minlength=cnt.size)
    for e in np.flatnonzero(have > cnt):
        for _ in range(int(have[e] - cnt[e])):
            slots = np.flatnonzero(row == e)
            loads = _rank_loads(row, per_replica, num_ranks)
            held = np.bincount(slots // s, minlength=num_ranks)
            # drop a duplicate on one rank first, then the copy on the most loaded rank
            order = [(-int(held[q // s]), -float(loads[q // s]), int(q)) for q in slots]
            row[slots[min(range(len(slots)), key=order.__getitem__)]] = -1
    need = np.maximum(cnt - np.bincount(row[row >= 0], minlength=cnt.size), 0)
    for e in np.argsort(-per_replica, kind="stable"):
        for _ in range(int(need[e])):
            free = np.flatnonzero(row < 0)
            loads = _rank_loads(row, per_replica, num_ranks)
            holds = np.isin(
                free // s, np.flatnonzero(np.bincount(np.flatnonzero(row == e) // s, minlength=num_ranks))
            )
            key = np.where(holds, np.inf, loads[free // s])
            if np.isinf(key).all():
                key = loads[free // s]
            row[free[int(np.argmin(key))]] = e
    return row


def relabel(row: np.ndarray, old_row: np.ndarray, num_ranks: int, num_logical: int) -> np.ndarray:
    """Permute whole ranks of ``row`` so they share the most experts with ``old_row``."""
    s = row.size // num_ranks
    new_c = np.zeros((num_ranks, num_logical), dtype=np.int64)
    old_c = np.zeros((num_ranks, num_logical), dtype=np.int64)
    np.add.at(new_c, (np.arange(row.size) // s, row), 1)
    np.add.at(old_c, (np.arange(row.size) // s, old_row), 1)
    overlap = np.minimum(new_c[:, None, :], old_c[None, :, :]).sum(-1)  # [new rank, old rank]
    target = np.full(num_ranks, -1)
    taken = np.zeros(num_ranks, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        a, b = divmod(int(flat), num_ranks)
        if target[a] < 0 and not taken[b]:
            target[a], taken[b] = b, True
    out = np.empty_like(row)
    for a in range(num_ranks):
        out[target[a] * s : (target[a] + 1) * s] = row[a * s : (a + 1) * s]
    return out


def _sticky_layer(weight: np.ndarray, old_row: np.ndarray, num_ranks: int, tolerance: float) -> np.ndarray:
    n_phys = old_row.size
    cnt = waterfill_counts(weight, n_phys)
    start = adjust_counts(old_row, cnt, weight, num_ranks)
    item_w = weight[start] / cnt[start]
    sticky, sticky_max = _refined(item_w, start, np.arange(n_phys) // (n_phys // num_ranks), num_ranks)
    fresh = _place_layer(weight, n_phys, num_ranks)
    fresh_max = float(_rank_loads(fresh, weight / np.bincount(fresh, minlength=weight.size), num_ranks).max())
    if sticky_max <= fresh_max * (1.0 + tolerance):
        return sticky
    return relabel(fresh, old_row, num_ranks, weight.size)


def _sticky(load: np.ndarray, spec: PlacementSpec, previous: Placement | None, tolerance: float) -> Placement:
    if previous is None:
        return waterfill_swap(load, spec)
    rows = [_sticky_layer(w, old, spec.num_ranks, tolerance) for w, old in zip(load, previous.phy2log)]
    return Placement.from_phy2log(np.stack(rows), spec.num_logical, spec.num_ranks)


@register_algorithm("waterfill_sticky")
def waterfill_sticky(load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None) -> Placement:
    return _sticky(load, spec, previous, tolerance=0.0)


@register_algorithm("sluice")
def sluice(load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None) -> Placement:
    """The project's recommended algorithm (the cluster spec's default name): now
    ``waterfill_sticky``."""
    return waterfill_sticky(load, spec, previous)


@register_algorithm("waterfill_sticky_lazy")
def waterfill_sticky_lazy(
    load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None
) -> Placement:
    return _sticky(load, spec, previous, tolerance=0.002)
