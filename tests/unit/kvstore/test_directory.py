"""The in-process directory against the Directory contract (Redis runs the same checks in
tests/integration/kvstore/test_redis_directory.py)."""

from __future__ import annotations

from kvstore.directory import InMemoryDirectory
from tests.unit.kvstore.directory_contract import check_directory_contract
from tests.unit.kvstore.fakes import Clock


def test_in_memory_directory_contract() -> None:
    clock = Clock(100.0)

    def advance(seconds: float) -> None:
        clock.t += seconds

    check_directory_contract(InMemoryDirectory(clock), advance)
