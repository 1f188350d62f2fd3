"""``RoutingConfig`` (what ``sluice serve --replicas/--router-policy`` builds) and its names."""

from __future__ import annotations

import pytest

from router.policy import DECODE_POLICIES, PREFILL_POLICIES
from services.routing.adapter import RouterAdapter  # noqa: F401  (registers every policy)
from services.routing.client import ROUTER_POLICIES, RoutingConfig


def test_defaults_serve_one_engine_without_a_router():
    cfg = RoutingConfig().resolve()
    assert cfg.replicas == 1 and cfg.policy == "" and not cfg.routed


def test_several_replicas_default_to_sluice_and_a_named_policy_routes_even_one():
    assert RoutingConfig(replicas=3).resolve().policy == "sluice"
    assert RoutingConfig(replicas=3, policy="round_robin").resolve().policy == "round_robin"
    assert RoutingConfig(replicas=1, policy="least_load").routed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"policy": "fastest"}, "known: round_robin, least_load, cache_aware, sluice"),
        ({"cache_event_capacity": 0}, "cache_event_capacity"),
        ({"cost_model_path": "/nonexistent/cost.json"}, "sluice bench engine --profile"),
    ],
)
def test_bad_settings_are_refused_with_what_to_do(kwargs, match):
    from pathlib import Path

    if "cost_model_path" in kwargs:
        kwargs = {"cost_model_path": Path(kwargs["cost_model_path"])}
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)


def test_the_cli_offers_exactly_the_registered_policies():
    from services.commands import serve

    registered = set(PREFILL_POLICIES.names()) & set(DECODE_POLICIES.names())
    assert set(ROUTER_POLICIES) == registered == set(serve.ROUTER_POLICIES)
