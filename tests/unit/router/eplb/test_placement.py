"""Placement types, the registry, and the properties every algorithm must keep."""

from __future__ import annotations

import numpy as np
import pytest

from router.eplb import (
    Placement,
    PlacementSpec,
    available_algorithms,
    compute_placement,
    get_algorithm,
    identity_placement,
    register_algorithm,
)
from router.eplb.deepseek import balanced_packing, replicate_experts


def _max_rank_load(placement: Placement, load: np.ndarray) -> np.ndarray:
    """[L] largest rank load under an exact (fractional) even split."""
    per_slot = np.take_along_axis(load, placement.phy2log, 1) / np.take_along_axis(
        placement.logcnt, placement.phy2log, 1
    )
    return per_slot.reshape(load.shape[0], placement.num_ranks, -1).sum(-1).max(-1)


def test_from_phy2log_derives_replicas_counts_and_log2phy() -> None:
    p = Placement.from_phy2log(np.array([[0, 2, 1, 2, 3, 2]]), num_logical=4, num_ranks=2)
    assert p.logcnt.tolist() == [[1, 1, 3, 1]]
    assert p.replica.tolist() == [[0, 0, 0, 1, 0, 2]]
    assert p.log2phy[0, 2].tolist() == [1, 3, 5]
    assert p.log2phy[0, 0].tolist() == [0, -1, -1]
    assert p.rank_of_slot().tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("phy2log", "msg"),
    [([[0, 1, 1, 1]], "has no physical slot"), ([[0, 1, 2, 7]], "outside"), ([[0, 1, 2]], "evenly")],
)
def test_from_phy2log_rejects_invalid(phy2log: list[list[int]], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        Placement.from_phy2log(np.array(phy2log), num_logical=3, num_ranks=2)


def test_spec_validation_messages() -> None:
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        PlacementSpec(num_logical=8, num_ranks=3, num_redundant_per_rank=1)
    with pytest.raises(ValueError, match="num_redundant_per_rank"):
        PlacementSpec(num_logical=8, num_ranks=2, num_redundant_per_rank=-1)
    spec = PlacementSpec(num_logical=256, num_ranks=64, num_redundant_per_rank=1, num_nodes=8, num_groups=8)
    assert (spec.num_physical, spec.slots_per_rank, spec.ranks_per_node) == (320, 5, 8)


def test_registry_unknown_name_lists_known_and_rejects_duplicates() -> None:
    assert {"deepseek_global", "deepseek_hierarchical", "waterfill_swap"} <= set(available_algorithms())
    with pytest.raises(ValueError, match="known: .*deepseek_global"):
        get_algorithm("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("deepseek_global")(get_algorithm("deepseek_global"))


def test_compute_placement_rejects_bad_load() -> None:
    spec = PlacementSpec(8, 2, 1)
    with pytest.raises(ValueError, match="load must be"):
        compute_placement("deepseek_global", np.ones((2, 7)), spec)
    with pytest.raises(ValueError, match="non-negative"):
        compute_placement("deepseek_global", -np.ones((2, 8)), spec)


def test_balanced_packing_heaviest_first_into_lightest_non_full() -> None:
    pack, rank = balanced_packing(np.array([9.0, 8, 7, 6, 5, 4]), 2)
    # 9->p0, 8->p1, 7->p1, 6->p0, 5->p0 (tie 15/15: lowest id), 4->p1 (p0 full)
    assert pack.tolist() == [0, 1, 1, 0, 0, 1]
    assert rank.tolist() == [0, 0, 1, 1, 2, 2]


def test_replicate_gives_extra_slots_by_load_per_replica() -> None:
    phy2log, cnt = replicate_experts(np.array([10.0, 1, 1, 4]), 7)
    # extras: 10/1 -> e0 (5), 5 vs 4 -> e0 (3.33), 4 -> e3 (2)
    assert phy2log.tolist() == [0, 1, 2, 3, 0, 0, 3]
    assert cnt.tolist() == [3, 1, 1, 2]


def _skewed(layers: int, experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.pareto(1.2, size=(layers, experts)) * 100 + 1


@pytest.mark.parametrize(
    "name", ["deepseek_global", "deepseek_hierarchical", "waterfill_swap", "waterfill_swap_hier"]
)
@pytest.mark.parametrize(
    ("experts", "ranks", "red", "nodes", "groups"), [(16, 2, 2, 1, 4), (32, 8, 1, 2, 4), (64, 16, 1, 4, 8)]
)
def test_algorithms_produce_valid_deterministic_placements(
    name: str, experts: int, ranks: int, red: int, nodes: int, groups: int
) -> None:
    spec = PlacementSpec(experts, ranks, red, num_nodes=nodes, num_groups=groups)
    load = _skewed(3, experts, seed=experts + ranks)
    p = compute_placement(name, load, spec)
    assert p.phy2log.shape == (3, spec.num_physical)
    assert (p.logcnt >= 1).all() and (p.logcnt.sum(1) == spec.num_physical).all()
    # hot experts get replicas: the hottest expert of each layer has the most slots
    assert (p.logcnt[np.arange(3), load.argmax(1)] == p.logcnt.max(1)).all()
    again = compute_placement(name, load.copy(), spec)
    np.testing.assert_array_equal(p.phy2log, again.phy2log)
    # balancing beats plain EP on skewed loads
    ident = identity_placement(3, experts, ranks)
    assert (_max_rank_load(p, load) < _max_rank_load(ident, load)).all()


def test_hierarchical_keeps_each_group_inside_one_node() -> None:
    spec = PlacementSpec(32, 8, 2, num_nodes=2, num_groups=4)
    load = _skewed(4, 32, seed=3)
    for name in ("deepseek_hierarchical", "waterfill_swap_hier"):
        p = compute_placement(name, load, spec)
        node_of_slot = p.rank_of_slot() // spec.ranks_per_node
        for layer in range(4):
            for group in range(4):
                slots = np.isin(p.phy2log[layer], np.arange(group * 8, group * 8 + 8))
                assert len(set(node_of_slot[slots].tolist())) == 1, (name, layer, group)


def test_ours_never_worse_than_baseline_on_the_window_it_fits() -> None:
    rng = np.random.default_rng(7)
    for trial in range(30):
        experts, ranks = [(16, 4), (32, 4), (64, 8), (64, 32)][trial % 4]
        spec = PlacementSpec(experts, ranks, int(rng.integers(0, 3)))
        load = _skewed(2, experts, seed=100 + trial)
        ours = _max_rank_load(compute_placement("waterfill_swap", load, spec), load)
        base = _max_rank_load(compute_placement("deepseek_global", load, spec), load)
        assert (ours <= base * (1 + 1e-12)).all(), trial


def test_ours_finds_perfect_balance_when_it_exists() -> None:
    # 2 ranks x 4 slots; loads {8, 4, 2, 2, 1, 1} + replicas: perfect split exists (one 8 -> 4+4)
    load = np.array([[8.0, 4, 2, 2, 1, 1]])
    spec = PlacementSpec(6, 2, 1)
    p = compute_placement("waterfill_swap", load, spec)
    assert _max_rank_load(p, load)[0] == pytest.approx(load.sum() / 2)
