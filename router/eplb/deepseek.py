"""Baseline: our reimplementation of the published deepseek-ai/EPLB algorithm.

Written from the algorithm's description (the README of deepseek-ai/EPLB and DeepSeek's
published EPLB settings, docs/eplb.md), not from its code:

- *Replication*: every logical expert starts with one slot; each extra slot goes to the
  expert with the largest ``load / replica_count`` (ties: lowest expert id).
- *Balanced packing*: items, heaviest first, go into the lightest pack that is not yet
  full; every pack takes exactly ``n_items / n_packs`` items (ties: lowest pack id).
- *Hierarchical*: pack expert groups to nodes (balanced packing of group loads), replicate
  experts within each node, then pack the node's physical replicas (load
  ``load / count``) onto the node's GPUs.
- *Global*: the hierarchical policy with one group and one node.
The published entry point uses hierarchical when ``num_groups % num_nodes == 0`` and global
otherwise; ``deepseek_hierarchical`` does the same.
"""

from __future__ import annotations

import numpy as np

from router.eplb.placement import Placement, PlacementSpec, register_algorithm


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` items [n] into ``num_packs`` packs of ``n / num_packs`` items each.

    Returns ``(pack_index [n], rank_in_pack [n])``.
    """
    n = weight.shape[0]
    if n % num_packs:
        raise ValueError(f"{n} items do not fill {num_packs} packs evenly")
    per_pack = n // num_packs
    pack_index = np.empty(n, dtype=np.int64)
    rank_in_pack = np.empty(n, dtype=np.int64)
    if per_pack == 1:
        pack_index[:] = np.arange(n)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    pack_load = np.zeros(num_packs, dtype=np.float64)
    pack_items = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        masked = np.where(pack_items < per_pack, pack_load, np.inf)
        pack = int(np.argmin(masked))
        pack_index[item] = pack
        rank_in_pack[item] = pack_items[pack]
        pack_load[pack] += weight[item]
        pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """Give ``num_phy - n`` extra slots to experts by largest load per replica.

    Returns ``(phy2log [num_phy], logcnt [n])``; slot ``i < n`` holds expert ``i``.
    """
    n = weight.shape[0]
    if num_phy < n:
        raise ValueError(f"{num_phy} physical slots cannot hold {n} experts")
    phy2log = np.empty(num_phy, dtype=np.int64)
    phy2log[:n] = np.arange(n)
    logcnt = np.ones(n, dtype=np.int64)
    for slot in range(n, num_phy):
        expert = int(np.argmax(weight / logcnt))
        phy2log[slot] = expert
        logcnt[expert] += 1
    return phy2log, logcnt


def _hierarchical_layer(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """One layer: ``weight`` [n_logical] -> phy2log [num_phy] (rank-major slots)."""
    n_log = weight.shape[0]
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    # 1. groups -> nodes; meta-logical ids are node-major
    group_pack, group_rank = balanced_packing(weight.reshape(num_groups, group_size).sum(-1), num_nodes)
    group_pos = group_pack * groups_per_node + group_rank  # [num_groups]
    log2mlog = (group_pos[:, None] * group_size + np.arange(group_size)[None, :]).ravel()
    mlog2log = np.empty(n_log, dtype=np.int64)
    mlog2log[log2mlog] = np.arange(n_log)
    # 2. replicate within each node, 3. pack the node's replicas to its GPUs
    log_per_node = n_log // num_nodes
    phy_per_node = num_phy // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_phy // num_gpus
    out = np.empty(num_phy, dtype=np.int64)
    for node in range(num_nodes):
        node_mlog = mlog2log[node * log_per_node : (node + 1) * log_per_node]
        node_w = weight[node_mlog]
        phy2nlog, cnt = replicate_experts(node_w, phy_per_node)
        pack, rank = balanced_packing(node_w[phy2nlog] / cnt[phy2nlog], gpus_per_node)
        slot = pack * phy_per_gpu + rank  # slot within the node, GPU-major
        node_out = np.empty(phy_per_node, dtype=np.int64)
        node_out[slot] = node_mlog[phy2nlog]
        out[node * phy_per_node : (node + 1) * phy_per_node] = node_out
    return out


def rebalance(load: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    """Published entry point shape: [L, n_logical] -> phy2log [L, num_phy]."""
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # the published fallback: global policy
    return np.stack([_hierarchical_layer(w, num_phy, num_groups, num_nodes, num_gpus) for w in load]).reshape(
        load.shape[0], num_phy
    )


@register_algorithm("deepseek_hierarchical")
def deepseek_hierarchical(
    load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None
) -> Placement:
    phy2log = rebalance(load, spec.num_physical, spec.num_groups, spec.num_nodes, spec.num_ranks)
    return Placement.from_phy2log(phy2log, spec.num_logical, spec.num_ranks)


@register_algorithm("deepseek_global")
def deepseek_global(load: np.ndarray, spec: PlacementSpec, previous: Placement | None = None) -> Placement:
    phy2log = rebalance(load, spec.num_physical, 1, 1, spec.num_ranks)
    return Placement.from_phy2log(phy2log, spec.num_logical, spec.num_ranks)
