"""The token split model: how an expert's tokens divide among its replicas.

This is the one definition the engine (``engine.eplb.ReplicaMap``) and the imbalance
evaluation share. Within one dispatching batch, the tokens routed to logical expert ``e``
are taken in arrival order (token-major, then top-k slot) and dealt round-robin over
``e``'s replicas in replica order, starting at replica ``offset mod r``. The j-th token
(0-based) of expert ``e`` goes to replica ``(j + offset) mod r``; so a replica receives
``floor(c / r)`` or ``ceil(c / r)`` tokens. The engine uses its DP rank as ``offset``, so
the remainders of different source ranks land on different replicas; the evaluation
applies the rule once to the aggregated count with offset 0.
"""

from __future__ import annotations

import numpy as np

from router.eplb.placement import Placement


def split_counts(
    count: np.ndarray, num_replicas: np.ndarray, replica_index: np.ndarray, offset: int = 0
) -> np.ndarray:
    """Tokens received by replica ``replica_index`` of an expert with ``count`` tokens and
    ``num_replicas`` replicas (arrays broadcast)."""
    count = np.asarray(count)
    num_replicas = np.asarray(num_replicas)
    q, rem = np.divmod(count, num_replicas)
    return q + (np.mod(np.asarray(replica_index) - offset, num_replicas) < rem)


def slot_loads(counts: np.ndarray, placement: Placement) -> np.ndarray:
    """Per physical slot token counts.

    ``counts`` [S, L, n_logical] (tokens per logical expert per step and layer)
    -> [S, L, n_phys].
    """
    if counts.ndim != 3 or counts.shape[1] != placement.num_layers:
        raise ValueError(f"counts must be [steps, {placement.num_layers}, n_logical], got {counts.shape}")
    layers = np.arange(placement.num_layers)[:, None]  # [L, 1]
    per_slot = counts[:, layers, placement.phy2log]  # [S, L, P]
    cnt = np.take_along_axis(placement.logcnt, placement.phy2log, axis=1)  # [L, P]
    return split_counts(per_slot, cnt[None], placement.replica[None])


def rank_loads(counts: np.ndarray, placement: Placement) -> np.ndarray:
    """Tokens per rank: [S, L, n_logical] -> [S, L, n_ranks]."""
    s, layers, _ = counts.shape
    loads = slot_loads(counts, placement)
    return loads.reshape(s, layers, placement.num_ranks, placement.slots_per_rank).sum(-1)
