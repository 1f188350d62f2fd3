"""Decode step time measured on the engine: a table over (running sequences, KV tokens).

``sluice bench router --profile-decode`` times one decode step of the engine's model
runner at every cell of a grid of ``batch`` (running sequences) x ``kv_tokens`` (KV tokens
summed over the batch) and writes the medians as JSON (``router/data/decode_step_table.json``,
with the preset, device, torch version, date and load average of the run).

``StepTable.step_time(B, K)`` interpolates it bilinearly in (B, K); outside the grid it
extrapolates the nearest cell linearly (never below the table's fastest step). Bilinear
interpolation reproduces any model ``d0 + d1*B + d2*K + d3*B*K`` exactly, so a linear
step model measured on the grid points is recovered between them. An engine running no
sequence takes no step: ``step_time(0, K) = 0``.

The table is the engine's truth in the simulator and the grader's yardstick. Routers never
read it: ``fit`` gives them a ``DecodeCostModel`` (least squares over the cells a decode
engine can reach), the model they score with.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from costmodel import DecodeCostModel

DEFAULT_TABLE = Path(__file__).resolve().parent / "data" / "decode_step_table.json"


def _cell(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower cell index and the position in it (< 0 or > 1 outside the grid: extrapolation)."""
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


@dataclass(frozen=True)
class StepTable:
    """Median decode step seconds ``seconds[i, j]`` at ``batch[i]`` sequences, ``kv_tokens[j]`` tokens."""

    batch: tuple[float, ...]
    kv_tokens: tuple[float, ...]
    seconds: np.ndarray  # [len(batch), len(kv_tokens)]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        b, k = np.asarray(self.batch, dtype=np.float64), np.asarray(self.kv_tokens, dtype=np.float64)
        s = np.asarray(self.seconds, dtype=np.float64)
        if len(b) < 2 or len(k) < 2:
            raise ValueError("StepTable needs >= 2 batch and >= 2 kv_tokens grid points")
        if np.any(np.diff(b) <= 0) or np.any(np.diff(k) <= 0):
            raise ValueError("StepTable grids must be strictly increasing")
        if s.shape != (len(b), len(k)) or not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise ValueError(f"StepTable.seconds must be finite, > 0 and of shape {(len(b), len(k))}")
        object.__setattr__(self, "seconds", s)

    def step_times(self, batch: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """Vectorised ``step_time``: any broadcastable shapes; 0 where ``batch <= 0``."""
        b = np.asarray(batch, dtype=np.float64)
        k = np.asarray(kv_tokens, dtype=np.float64)
        b, k = np.broadcast_arrays(b, k)
        bg, kg, s = np.asarray(self.batch, float), np.asarray(self.kv_tokens, float), self.seconds
        i, u = _cell(bg, b)
        j, v = _cell(kg, k)
        out = (
            s[i, j] * (1 - u) * (1 - v)
            + s[i + 1, j] * u * (1 - v)
            + s[i, j + 1] * (1 - u) * v
            + s[i + 1, j + 1] * u * v
        )
        return np.where(b > 0, np.maximum(out, s.min()), 0.0)

    def step_time(self, batch: int, kv_tokens: float) -> float:
        """``step_times`` for one engine, in plain Python (the simulator calls it per event)."""
        if batch <= 0:
            return 0.0
        bg, kg, s = self._lists
        i = min(max(bisect.bisect_right(bg, batch) - 1, 0), len(bg) - 2)
        j = min(max(bisect.bisect_right(kg, kv_tokens) - 1, 0), len(kg) - 2)
        u = (batch - bg[i]) / (bg[i + 1] - bg[i])
        v = (kv_tokens - kg[j]) / (kg[j + 1] - kg[j])
        out = (
            s[i][j] * (1 - u) * (1 - v)
            + s[i + 1][j] * u * (1 - v)
            + s[i][j + 1] * (1 - u) * v
            + s[i + 1][j + 1] * u * v
        )
        return max(out, self._min)

    @functools.cached_property
    def _lists(self) -> tuple[list[float], list[float], list[list[float]]]:
        return [float(b) for b in self.batch], [float(k) for k in self.kv_tokens], self.seconds.tolist()

    @functools.cached_property
    def _min(self) -> float:
        return float(self.seconds.min())

    def samples(self, max_tokens_per_sequence: float | None = None) -> list[tuple[float, float, float]]:
        """``(batch, kv_tokens, seconds)`` per cell, optionally only cells whose sequences are
        at most ``max_tokens_per_sequence`` deep on average."""
        return [
            (b, k, float(self.seconds[i, j]))
            for i, b in enumerate(self.batch)
            for j, k in enumerate(self.kv_tokens)
            if max_tokens_per_sequence is None or k / b <= max_tokens_per_sequence
        ]

    def fit(self, max_tokens_per_sequence: float | None = None) -> DecodeCostModel:
        """The router's linear step model, least squares over the (reachable) cells."""
        return DecodeCostModel.fit(self.samples(max_tokens_per_sequence))

    def to_json(self) -> str:
        raw = dict(self.meta) | {
            "kind": "decode_step_table",
            "batch": list(self.batch),
            "kv_tokens": list(self.kv_tokens),
            "seconds": self.seconds.tolist(),
        }
        return json.dumps(raw, indent=1)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepTable:
        if raw.get("kind") != "decode_step_table":
            raise ValueError("not a decode step table (kind != 'decode_step_table')")
        meta = {k: v for k, v in raw.items() if k not in ("kind", "batch", "kv_tokens", "seconds")}
        return cls(tuple(raw["batch"]), tuple(raw["kv_tokens"]), np.asarray(raw["seconds"], float), meta)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> StepTable:
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"decode step table {p} not found; measure one with "
                f"`sluice bench router --profile-decode --step-table {p}`"
            )
        return cls.from_dict(json.loads(p.read_text()))


def table_from_model(model: DecodeCostModel, batch: Sequence[float], kv_tokens: Sequence[float]) -> StepTable:
    """A table sampled from a linear model (tests, and comparing against a measured table)."""
    s = np.array([[model.step_time(int(b), k) for k in kv_tokens] for b in batch])
    return StepTable(tuple(batch), tuple(kv_tokens), s, {"source": "model", "model": model.to_json()})
