"""Prefill step-time cost model (pure numpy): the minimal API Engine II needs.

    step_time(C, H) = a * C * (C + H) + b * (C + H) + c        [seconds]

``C`` is the chunk (new tokens computed in the step), ``H`` the tokens already in the
sequence's caches. Placeholder written on branch engine2 because the router branch had not
committed its version yet; the router's ``CostModel`` (same fields, same JSON ``kind``)
supersedes this file when the branches are reconciled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_CHUNK_BUDGET = 32_768


@dataclass(frozen=True)
class CostModel:
    a: float
    b: float
    c: float
    chunk_budget: int = DEFAULT_CHUNK_BUDGET

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel needs a > 0 or b > 0: a model with a = b = 0 predicts free prefill")
        if self.chunk_budget < 1:
            raise ValueError(f"CostModel.chunk_budget must be >= 1 token, got {self.chunk_budget}")

    def predict(self, chunk: float, prefix: float) -> float:
        total = chunk + prefix
        return self.a * chunk * total + self.b * total + self.c

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[float, float, float]], chunk_budget: int = DEFAULT_CHUNK_BUDGET
    ) -> CostModel:
        """Least squares from ``(chunk, prefix, seconds)`` samples; coefficients clipped at 0."""
        arr = np.asarray(list(samples), dtype=np.float64)
        if arr.ndim != 2 or arr.shape[0] < 3 or arr.shape[1] != 3:
            raise ValueError("CostModel.fit needs >= 3 samples of (chunk, prefix, seconds)")
        chunk, prefix, y = arr[:, 0], arr[:, 1], arr[:, 2]
        x = np.stack([chunk * (chunk + prefix), chunk + prefix, np.ones_like(chunk)], axis=1)  # [S, 3]
        if np.linalg.matrix_rank(x) < 3:
            raise ValueError("CostModel.fit: samples do not vary enough in chunk and prefix to fit a, b, c")
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        a, b, c = (max(float(v), 0.0) for v in coef)
        return cls(a=a, b=b, c=c, chunk_budget=chunk_budget)

    def to_json(self) -> str:
        return json.dumps({"kind": "prefill_quadratic", **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        raw = json.loads(text)
        if raw.pop("kind", "prefill_quadratic") != "prefill_quadratic":
            raise ValueError("not a prefill cost model JSON (kind != 'prefill_quadratic')")
        unknown = set(raw) - {"a", "b", "c", "chunk_budget"}
        if unknown:
            raise ValueError(f"unknown CostModel fields {sorted(unknown)}; expected a, b, c, chunk_budget")
        return cls(**raw)
