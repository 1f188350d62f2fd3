"""The confidence head's held-out measures (numpy only): AUC, Brier score, log-loss, and a
calibration report with reliability bins, expected calibration error and per-position figures."""

from __future__ import annotations

from typing import Any

import numpy as np


def auc(p: np.ndarray, y: np.ndarray) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties counted half); None with a single class."""
    n1 = float(y.sum())
    n0 = float(len(y) - n1)
    if n1 == 0 or n0 == 0:
        return None
    _, inv, counts = np.unique(p, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct value
    ranks = avg_rank[inv]
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def brier(p: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((p - y) ** 2)) if len(y) else 0.0


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    q = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))) if len(y) else 0.0


def calibration(
    p: np.ndarray,
    y: np.ndarray,
    position: np.ndarray,
    train_rate: float,
    train_position_rates: list[float],
    bins: int = 10,
) -> dict[str, Any]:
    """Brier, log-loss and AUC beside constant predictors; reliability bins, ECE; per position."""
    p = p.astype(np.float64)
    y = y.astype(np.float64)
    n = len(y)
    rate = float(y.mean()) if n else 0.0
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, bins - 1)
    table = []
    ece = 0.0
    for k in range(bins):
        sel = which == k
        c = int(sel.sum())
        row: dict[str, Any] = {"lo": float(edges[k]), "hi": float(edges[k + 1]), "n": c}
        if c:
            row["mean_confidence"] = float(p[sel].mean())
            row["observed"] = float(y[sel].mean())
            ece += c / n * abs(row["mean_confidence"] - row["observed"])
        table.append(row)
    per_pos_const = np.array([train_position_rates[int(j) - 1] for j in position])
    positions = []
    for j in range(1, len(train_position_rates) + 1):
        sel = position == j
        positions.append(
            {
                "position": j,
                "n": int(sel.sum()),
                "mean_confidence": float(p[sel].mean()) if sel.any() else None,
                "observed": float(y[sel].mean()) if sel.any() else None,
                "brier": brier(p[sel], y[sel]),
                "brier_constant": brier(np.full(int(sel.sum()), train_position_rates[j - 1]), y[sel]),
                "auc": auc(p[sel], y[sel]),
            }
        )
    return {
        "n": n,
        "observed": rate,
        "mean_confidence": float(p.mean()) if n else 0.0,
        "brier": brier(p, y),
        "brier_constant_train_rate": brier(np.full(n, train_rate), y),
        "brier_constant_own_rate": rate * (1 - rate),  # the best constant, knowing the answers' rate
        "brier_constant_per_position": brier(per_pos_const, y),
        "log_loss": log_loss(p, y),
        "log_loss_constant_train_rate": log_loss(np.full(n, train_rate), y),
        "auc": auc(p, y),
        "ece": float(ece),
        "bins": table,
        "positions": positions,
    }
