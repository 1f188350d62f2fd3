"""EPLB placement core (pure, numpy only): algorithms, token split model, imbalance metric,
synthetic load generator and the window/period simulation. See docs/eplb.md."""

from router.eplb.metric import balancedness, imbalance, imbalance_matrix
from router.eplb.placement import (
    Placement,
    PlacementSpec,
    available_algorithms,
    compute_placement,
    get_algorithm,
    identity_placement,
    register_algorithm,
)
from router.eplb.split import rank_loads, slot_loads, split_counts

__all__ = [
    "Placement",
    "PlacementSpec",
    "available_algorithms",
    "balancedness",
    "compute_placement",
    "get_algorithm",
    "identity_placement",
    "imbalance",
    "imbalance_matrix",
    "rank_loads",
    "register_algorithm",
    "slot_loads",
    "split_counts",
]
