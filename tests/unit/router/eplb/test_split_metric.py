"""The token split model and the imbalance metric."""

from __future__ import annotations

import numpy as np
import pytest

from router.eplb import Placement, balancedness, imbalance, rank_loads, slot_loads, split_counts


def test_split_is_round_robin_with_offset() -> None:
    # 7 tokens over 3 replicas: replica 0 gets tokens 0,3,6 -> 3; 1 -> 2; 2 -> 2
    assert split_counts(7, 3, np.arange(3)).tolist() == [3, 2, 2]
    # offset 1: token j goes to replica (j + 1) % 3 -> replica 1 receives the remainder
    assert split_counts(7, 3, np.arange(3), offset=1).tolist() == [2, 3, 2]
    counts = np.arange(50)
    for r in (1, 2, 5):
        parts = np.stack([split_counts(counts, r, i) for i in range(r)])
        assert (parts.sum(0) == counts).all()
        assert (parts.max(0) - parts.min(0) <= 1).all()


def test_rank_loads_follow_placement_and_conserve_tokens() -> None:
    # ranks: [e0, e1 | e0, e2]; expert 0 has two replicas
    p = Placement.from_phy2log(np.array([[0, 1, 0, 2]]), num_logical=3, num_ranks=2)
    counts = np.array([[[9, 4, 2]]])  # [S=1, L=1, E=3]
    assert slot_loads(counts, p).tolist() == [[[5, 4, 4, 2]]]
    assert rank_loads(counts, p).tolist() == [[[9, 6]]]
    rng = np.random.default_rng(0)
    many = rng.integers(0, 1000, size=(20, 1, 3))
    assert (rank_loads(many, p).sum(-1) == many.sum(-1)).all()


def test_imbalance_is_max_over_mean_averaged_over_layers_and_steps() -> None:
    loads = np.array([[[3, 1], [2, 2]], [[4, 0], [1, 1]]])  # [S=2, L=2, R=2]
    # per (step, layer): 1.5, 1.0, 2.0, 1.0 -> mean 1.375
    assert imbalance(loads) == pytest.approx(1.375)
    assert balancedness(loads) == pytest.approx((2 + 2 + 2 + 1) / (3 + 2 + 4 + 1))


def test_imbalance_skips_empty_steps_and_rejects_all_empty() -> None:
    assert imbalance(np.array([[[0, 0]], [[3, 1]]])) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="undefined"):
        imbalance(np.zeros((2, 1, 4)))
