"""Imbalance metrics.

DeepSeek's imbalance: for one step and one layer, the load of the slowest (most loaded)
rank divided by the mean rank load; reported as the average over layers and steps.
1.0 is perfect balance. Steps/layers with no tokens at all are left out of the average.
"""

from __future__ import annotations

import numpy as np


def imbalance_matrix(loads: np.ndarray) -> np.ndarray:
    """[..., n_ranks] rank loads -> [...] max/mean (NaN where the total load is 0)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, loads.max(-1) / np.where(mean > 0, mean, 1.0), np.nan)


def imbalance(loads: np.ndarray) -> float:
    """DeepSeek's figure: mean over steps and layers of per-layer max/mean over ranks.

    ``loads`` [S, L, n_ranks]."""
    m = imbalance_matrix(loads)
    if np.isnan(m).all():
        raise ValueError("no step carries any load; imbalance is undefined")
    return float(np.nanmean(m))


def balancedness(loads: np.ndarray) -> float:
    """vLLM's figure for reference: sum of means / sum of maxes (1.0 is perfect)."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.mean(-1).sum() / loads.max(-1).sum())
