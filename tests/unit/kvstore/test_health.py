"""The client's per-node circuit breaker: back-off doubling, capped, reset by an answer."""

from __future__ import annotations

import pytest

from kvstore.health import NodeHealth
from tests.unit.kvstore.fakes import Clock


def test_a_failed_node_is_avoided_for_a_back_off_that_doubles_up_to_the_cap() -> None:
    clock = Clock(100.0)
    health = NodeHealth(base_s=1.0, max_s=4.0, clock=clock)
    assert health.avoided() == frozenset()
    for expected in (1.0, 2.0, 4.0, 4.0):
        health.failed("n01")
        assert health.avoided() == {"n01"}
        clock.t += expected - 0.01
        assert health.avoided() == {"n01"}
        clock.t += 0.02  # past the back-off: the next read tries it again
        assert health.avoided() == frozenset()
    assert health.failures("n01") == 4


def test_an_answer_makes_a_node_healthy_again() -> None:
    clock = Clock(100.0)
    health = NodeHealth(clock=clock)
    health.failed("a")
    health.failed("b")
    health.answered("a")
    assert health.avoided() == {"b"} and health.failures("a") == 0
    health.failed("a")  # the back-off starts over after an answer
    clock.t += 1.01
    assert health.avoided() == frozenset()


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_bad_back_off_settings_are_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="back-off"):
        NodeHealth(base_s=base, max_s=cap)
