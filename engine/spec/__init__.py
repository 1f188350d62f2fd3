"""Speculative decoding: DSpark's confidence scheduling (pure) and its simulator."""

from engine.spec.dspark import (
    DSparkPlan,
    choose_policy,
    expected_accepted,
    expected_total,
    fixed_k_from_means,
    plan_dspark,
    plan_dspark_depths,
    select_dspark,
    select_fixed,
    select_oracle,
    survival,
)
from engine.spec.lagged import LaggedConfidence
from engine.spec.step_table import StepProfile, throughput

__all__ = [
    "DSparkPlan",
    "LaggedConfidence",
    "StepProfile",
    "choose_policy",
    "expected_accepted",
    "expected_total",
    "fixed_k_from_means",
    "plan_dspark",
    "plan_dspark_depths",
    "select_dspark",
    "select_fixed",
    "select_oracle",
    "survival",
    "throughput",
]
