"""Speculative decoding: DSpark's confidence scheduling (pure) and its simulator."""

from engine.spec.dspark import (
    DSparkPlan,
    LaggedConfidence,
    StepProfile,
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
    throughput,
)

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
