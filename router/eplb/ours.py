"""Sluice's placement: water-filled replica counts, spread LPT packing, swap refinement.

``waterfill_swap`` (global over the EP group):

1. Replica counts by water-filling: each extra slot goes to the expert whose per-replica
   load ``load / count`` is the highest (this minimises the largest per-replica load; it
   is the same rule as the baseline's replication).
2. LPT packing with a spread rule: replicas, heaviest first, go to the least-loaded rank
   that still has a free slot *and* does not hold a replica of the same expert yet (two
   replicas of one expert on one rank balance nothing; spreading them also spreads that
   expert's step-to-step bursts). Falls back to any non-full rank.
3. Swap refinement: repeatedly take the most loaded rank and, over every other rank and
   every pair of slots, apply the swap that brings the two ranks' larger load lowest, as
   long as it lowers the maximum; stops at a local optimum or after a bounded number of
   swaps. Slot counts per rank never change.
4. Steps 2-3 also run from the baseline's own packing; the lower maximum wins, so on the
   window it is fitted to, the result is never worse than ``deepseek_global``.

``waterfill_swap_hier`` keeps DeepSeek's node structure (groups packed to nodes first) and
runs steps 1-3 inside each node, for deployments where weight moves must stay in a node.
"""

from __future__ import annotations

import numpy as np

from router.eplb.deepseek import balanced_packing, replicate_experts
from router.eplb.placement import Placement, PlacementSpec, register_algorithm


def waterfill_counts(weight: np.ndarray, num_phy: int) -> np.ndarray:
    """Replica count per expert [n] (>= 1, summing to ``num_phy``) minimising the largest
    ``weight / count``: each extra slot tops up the currently highest per-replica load."""
    n = weight.shape[0]
    if num_phy < n:
        raise ValueError(f"{num_phy} physical slots cannot hold {n} experts")
    cnt = np.ones(n, dtype=np.int64)
    for _ in range(num_phy - n):
        cnt[int(np.argmax(weight / cnt))] += 1
    return cnt


def spread_lpt(item_w: np.ndarray, item_expert: np.ndarray, num_ranks: int) -> np.ndarray:
    """Pack items [n] onto ``num_ranks`` ranks of ``n / num_ranks`` slots: returns the rank
    of each item (heaviest first, least-loaded rank without that expert, then any)."""
    n = item_w.shape[0]
    per_rank = n // num_ranks
    rank_load = np.zeros(num_ranks)
    rank_items = np.zeros(num_ranks, dtype=np.int64)
    holds: dict[int, set[int]] = {}
    out = np.empty(n, dtype=np.int64)
    for item in np.argsort(-item_w, kind="stable"):
        e = int(item_expert[item])
        free = rank_items < per_rank
        taken = holds.setdefault(e, set())
        ok = free.copy()
        if taken:
            ok[list(taken)] = False
        cand = ok if ok.any() else free
        rank = int(np.argmin(np.where(cand, rank_load, np.inf)))
        out[item] = rank
        rank_load[rank] += item_w[item]
        rank_items[rank] += 1
        taken.add(rank)
    return out


def swap_refine(slot_w: np.ndarray, max_swaps: int) -> np.ndarray:
    """Local search on a [R, s] matrix of slot loads (row = rank). Returns the permutation
    [R * s] of flat slot positions after swaps (new position -> original item)."""
    w = slot_w.astype(np.float64).copy()
    n_ranks, s = w.shape
    perm = np.arange(n_ranks * s).reshape(n_ranks, s)
    loads = w.sum(1)
    for _ in range(max_swaps):
        h = int(np.argmax(loads))
        top = loads[h]
        d = w[h][None, :, None] - w[:, None, :]  # [R, s_h, s_o]: load moved from h to o
        pair_max = np.maximum(top - d, loads[:, None, None] + d)
        pair_max[h] = np.inf
        best = int(np.argmin(pair_max))
        o, a, b = np.unravel_index(best, pair_max.shape)
        if not pair_max[o, a, b] < top - 1e-9 * max(top, 1.0):
            break
        delta = d[o, a, b]
        w[h, a], w[o, b] = w[o, b], w[h, a]
        perm[h, a], perm[o, b] = perm[o, b], perm[h, a]
        loads[h] -= delta
        loads[o] += delta
    return perm.ravel()


def _refined(item_w: np.ndarray, item_expert: np.ndarray, rank: np.ndarray, num_ranks: int):
    """Lay items out rank-major by ``rank`` and swap-refine; returns (phy2log, max load)."""
    order = np.argsort(rank, kind="stable")  # items grouped by rank -> [R, s] layout
    s = item_w.shape[0] // num_ranks
    slot_w = item_w[order].reshape(num_ranks, s)
    perm = swap_refine(slot_w, max_swaps=4 * num_ranks + 64)
    phy2log = item_expert[order][perm]
    return phy2log, float(item_w[order][perm].reshape(num_ranks, s).sum(1).max())


def _place_layer(weight: np.ndarray, num_phy: int, num_ranks: int) -> np.ndarray:
    """[n] expert loads -> phy2log [num_phy] (rank-major).

    Two starts, each swap-refined, the lower maximum wins (ties: the spread start): the
    spread LPT, and the baseline's own replication + balanced packing. Refinement never
    raises the maximum, so the result is never worse than the baseline on the window."""
    cnt = waterfill_counts(weight, num_phy)
    item_expert = np.repeat(np.arange(weight.shape[0]), cnt)  # [num_phy]
    item_w = weight[item_expert] / cnt[item_expert]
    spread, spread_max = _refined(item_w, item_expert, spread_lpt(item_w, item_expert, num_ranks), num_ranks)
    base_expert, base_cnt = replicate_experts(weight, num_phy)
    base_w = weight[base_expert] / base_cnt[base_expert]
    base_rank, _ = balanced_packing(base_w, num_ranks)
    base, base_max = _refined(base_w, base_expert, base_rank, num_ranks)
    return spread if spread_max <= base_max else base


@register_algorithm("waterfill_swap")
def waterfill_swap(load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None) -> Placement:
    phy2log = np.stack([_place_layer(w, spec.num_physical, spec.num_ranks) for w in load])
    return Placement.from_phy2log(phy2log, spec.num_logical, spec.num_ranks)


@register_algorithm("waterfill_swap_hier")
def waterfill_swap_hier(
    load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None
) -> Placement:
    if spec.num_nodes == 1 or spec.num_groups % spec.num_nodes:
        return waterfill_swap(load, spec, previous)
    n_log, n_nodes = spec.num_logical, spec.num_nodes
    group_size = n_log // spec.num_groups
    phy_per_node = spec.num_physical // n_nodes
    rows = []
    for w in load:
        pack, rank = balanced_packing(w.reshape(spec.num_groups, group_size).sum(-1), n_nodes)
        out = np.empty(spec.num_physical, dtype=np.int64)
        for node in range(n_nodes):
            groups = np.flatnonzero(pack == node)[np.argsort(rank[pack == node])]
            experts = (groups[:, None] * group_size + np.arange(group_size)[None, :]).ravel()
            local = _place_layer(w[experts], phy_per_node, spec.ranks_per_node)
            out[node * phy_per_node : (node + 1) * phy_per_node] = experts[local]
        rows.append(out)
    return Placement.from_phy2log(np.stack(rows), spec.num_logical, spec.num_ranks)
