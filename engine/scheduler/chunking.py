"""Chunk sizing by the fitted quadratic step-time model (pure).

A step's predicted time is ``c`` (once) plus, for every scheduled sequence with ``C`` new
tokens after ``H`` computed ones, ``a*C*(C+H) + b*(C+H) + d*C``. A prefill chunk takes the
largest ``C`` with ``C <= tokens_left`` and ``a*C^2 + (a*H + b + d)*C + b*H <= time_left``,
solved in closed form (the positive root of the quadratic).
"""

from __future__ import annotations

import math
from typing import Protocol


class StepCostModel(Protocol):
    """``costmodel.CostModel``: step_time(C, H) = a*C*(C+H) + b*(C+H) + d*C + c."""

    @property
    def a(self) -> float: ...
    @property
    def b(self) -> float: ...
    @property
    def c(self) -> float: ...
    @property
    def d(self) -> float: ...
    def predict(self, chunk: float, prefix: float) -> float: ...


def seq_cost(model: StepCostModel, chunk: int, prefix: int) -> float:
    """Marginal seconds one sequence adds to a step (the constant ``c`` is per step): the
    model's own prediction, so no term can be left out here again."""
    return model.predict(chunk, prefix) - model.c


def largest_chunk(model: StepCostModel, prefix: int, tokens_left: int, time_left: float | None) -> int:
    """Largest chunk that fits both budgets (0 if not even one token fits)."""
    if tokens_left <= 0:
        return 0
    if time_left is None or math.isinf(time_left):
        return tokens_left
    a, b = model.a, model.b
    rhs = time_left - b * prefix  # a*C^2 + (a*H + b + d)*C <= rhs
    if rhs <= 0:
        return 0
    lin = a * prefix + b + model.d
    if a == 0.0:  # then b or d > 0 (CostModel refuses a model where all three are 0)
        c_max = rhs / lin
    else:
        c_max = (-lin + math.sqrt(lin * lin + 4.0 * a * rhs)) / (2.0 * a)
    chunk = min(tokens_left, int(math.floor(c_max + 1e-9)))
    # Guard against rounding at the boundary: never exceed the budget.
    while chunk > 0 and seq_cost(model, chunk, prefix) > time_left * (1 + 1e-12):
        chunk -= 1
    return max(chunk, 0)
