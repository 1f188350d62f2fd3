"""The SWA directory, both backends (a real redis-server for Redis): entries by anchor,
withdrawal, leases that end with their holder, and a clean leave."""

from __future__ import annotations

import time

import pytest

from engine.kvconnector.swa_directory import (
    InMemorySlotDirectory,
    RedisSlotDirectory,
    SlotLocation,
    open_slot_directory,
)

A, B = b"\x01" * 32, b"\x02" * 32


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def directory(request):
    clock = _Clock()
    if request.param == "memory":
        d = InMemorySlotDirectory(clock)

        def expire(lease_s: float) -> None:
            clock.now += lease_s + 0.01

    else:
        d = RedisSlotDirectory(request.getfixturevalue("redis_url"))

        def expire(lease_s: float) -> None:
            time.sleep(lease_s + 0.05)

    d.expire = expire  # type: ignore[attr-defined]
    yield d
    d.close()


def test_entries_are_found_by_anchor_while_their_holder_lives(directory):
    directory.heartbeat("10.0.0.1:7001", 0.3)
    directory.heartbeat("10.0.0.2:7001", 30)
    directory.publish("10.0.0.1:7001", A, (5, 6, 7))
    directory.publish("10.0.0.2:7001", A, ())
    directory.publish("10.0.0.2:7001", B, (9,))
    got = set(directory.locate([A]))
    assert got == {SlotLocation(A, (5, 6, 7), "10.0.0.1:7001"), SlotLocation(A, (), "10.0.0.2:7001")}
    directory.publish("10.0.0.2:7001", A, (5, 6, 7))  # two engines hold the same slot
    assert len(directory.locate([A])) == 3
    directory.withdraw("10.0.0.2:7001", A, ())
    directory.withdraw("10.0.0.2:7001", A, (5, 6, 7))
    directory.withdraw("10.0.0.9:7001", A, (5, 6, 7))  # not its entry: nothing happens
    assert directory.locate([A]) == [SlotLocation(A, (5, 6, 7), "10.0.0.1:7001")]
    directory.expire(0.3)  # the first holder stopped renewing its lease
    assert directory.locate([A, B]) == [SlotLocation(B, (9,), "10.0.0.2:7001")]
    directory.heartbeat("10.0.0.1:7001", 30)  # back, but its entries are gone with its lease
    assert directory.locate([A]) == [] or isinstance(directory, InMemorySlotDirectory)


def test_a_holder_that_leaves_takes_its_entries(directory):
    directory.heartbeat("h:1", 30)
    directory.heartbeat("h:2", 30)
    directory.publish("h:1", A, (1,))
    directory.publish("h:1", B, (2,))
    directory.publish("h:2", B, (3,))
    directory.publish("h:2", A, (1,))
    directory.leave("h:1")
    assert set(directory.locate([A, B])) == {SlotLocation(B, (3,), "h:2"), SlotLocation(A, (1,), "h:2")}
    with pytest.raises(ValueError, match="holder"):
        directory.publish("", A, ())


def test_open_slot_directory_names_what_it_takes():
    assert isinstance(open_slot_directory("memory"), InMemorySlotDirectory)
    with pytest.raises(ValueError, match="Redis URL"):
        open_slot_directory("etcd://x")
