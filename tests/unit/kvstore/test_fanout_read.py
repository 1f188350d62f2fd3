"""Reads over in-process shard transports: decode as objects complete, hedging policies,
repair reporting. The transports follow the ShardTransport contract (no network)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.codec import Codec, new_object_id
from kvstore.fanout import ObjectLost, ObjectRef, ObjectUnavailable, first_shards, read_objects
from kvstore.health import NodeHealth
from kvstore.shardfmt import Shard
from kvstore.transport import Cancel, NodeUnavailable, OnShards, ShardMissing, ShardResult

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone

K, M = 10, 2
NODES = tuple(f"n{i:02d}" for i in range(K + M))


class FakeNode:
    """A node holding shards in memory; can be down, slow, or missing/corrupting shards."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.shards: dict[tuple[bytes, int], Shard] = {}
        self.down = False
        self.delay_s = 0.0
        self.corrupt: set[tuple[bytes, int]] = set()
        self.asked: list[tuple[bytes, int]] = []
        self._lock = threading.Lock()

    def get_shards(
        self,
        refs: Sequence[tuple[bytes, int]],
        timeout_s: float,
        on_shards: OnShards,
        cancel: Cancel | None = None,
    ) -> None:
        with self._lock:
            self.asked += refs
        time.sleep(min(self.delay_s, timeout_s))
        out: list[tuple[int, ShardResult]] = []
        for pos, ref in enumerate(refs):
            if self.down or self.delay_s >= timeout_s:  # bounded by the timeout, as the contract says
                out.append((pos, NodeUnavailable(self.node_id, "UNAVAILABLE")))
            elif ref not in self.shards:
                out.append((pos, ShardMissing(self.node_id, "NOT_FOUND")))
            elif ref in self.corrupt:
                s = self.shards[ref]
                out.append((pos, Shard(s.header, bytes([s.payload[0] ^ 1]) + bytes(s.payload[1:]))))
            else:
                out.append((pos, self.shards[ref]))
        on_shards(out[: len(out) // 2])  # in two messages, as a stream delivers them
        on_shards(out[len(out) // 2 :])


@pytest.fixture()
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(32) as p:
        yield p


def _store(
    count: int = 6, size: int = 50_000
) -> tuple[Codec, dict[str, FakeNode], list[ObjectRef], list[bytes]]:
    codec = Codec()
    nodes = {n: FakeNode(n) for n in NODES}
    refs, datas = [], []
    for i in range(count):
        oid, data = new_object_id(), os.urandom(size + i)
        group = NODES[i % 3 :] + NODES[: i % 3]  # groups differ by object
        for shard, node in zip(codec.encode(oid, data, 2), group):
            nodes[node].shards[(oid, shard.index)] = shard
        refs.append(ObjectRef(oid, group))
        datas.append(data)
    return codec, nodes, refs, datas


def _asked_indices(nodes: dict[str, FakeNode]) -> set[int]:
    return {i for n in nodes.values() for _, i in n.asked}


def test_eager_reads_ask_every_shard_and_decode_each_object(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, datas = _store()
    assert read_objects(pool, codec, nodes, refs, 2.0) == datas  # type: ignore[arg-type]
    deadline = time.monotonic() + 2.0  # the stragglers' streams may still be starting
    while sum(len(n.asked) for n in nodes.values()) < len(refs) * (K + M) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _asked_indices(nodes) == set(range(K + M))
    assert sum(len(n.asked) for n in nodes.values()) == len(refs) * (K + M)


def test_data_first_reads_move_only_data_shards_when_healthy(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, datas = _store()
    got = read_objects(pool, codec, nodes, refs, 2.0, hedge_factor=50.0, hedge_min_s=1.0)  # type: ignore[arg-type]
    assert got == datas
    assert _asked_indices(nodes) == set(range(K))


@pytest.mark.parametrize("fault", ["down", "missing", "corrupt"])
def test_a_failed_data_shard_brings_in_parity_at_once(pool: ThreadPoolExecutor, fault: str) -> None:
    codec, nodes, refs, datas = _store()
    settled: dict[int, set[int]] = {}
    bad = nodes["n04"]
    if fault == "down":
        bad.down = True
    elif fault == "missing":
        bad.shards.clear()
    else:
        bad.corrupt = set(bad.shards)
    start = time.monotonic()
    got = read_objects(
        pool,
        codec,
        nodes,
        refs,
        2.0,
        settled.__setitem__,
        hedge_factor=50.0,
        hedge_min_s=1.0,  # type: ignore[arg-type]
    )
    assert got == datas
    assert time.monotonic() - start < 0.5  # not the 1 s hedge timer: the failure triggered it
    assert _asked_indices(nodes) >= {K, K + 1}
    if fault != "down":  # missing or corrupt on a live node: reported for repair, once
        deadline = time.monotonic() + 2.0  # every reply is in (the stragglers settle it)
        while not settled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert settled and all(bad_idx == {refs[o].nodes.index("n04")} for o, bad_idx in settled.items())


def test_a_slow_node_is_hedged_by_the_timer(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, datas = _store()
    nodes["n05"].delay_s = 1.5
    start = time.monotonic()
    got = read_objects(pool, codec, nodes, refs, 3.0, hedge_factor=2.0, hedge_min_s=0.02)  # type: ignore[arg-type]
    assert got == datas
    assert time.monotonic() - start < 1.0


def test_more_than_m_shards_gone_is_lost_and_too_few_replies_is_unavailable(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, _ = _store(count=1)
    for node in refs[0].nodes[:3]:
        nodes[node].shards.clear()
    for factor in (None, 2.0):
        (got,) = read_objects(pool, codec, nodes, refs[:1], 1.0, hedge_factor=factor)  # type: ignore[arg-type]
        assert isinstance(got, ObjectLost)
    codec, nodes, refs, _ = _store(count=1)
    for node in refs[0].nodes[-3:]:
        nodes[node].down = True
    for factor in (None, 2.0):
        start = time.monotonic()
        (got,) = read_objects(pool, codec, nodes, refs[:1], 1.0, hedge_factor=factor)  # type: ignore[arg-type]
        assert isinstance(got, ObjectUnavailable) and time.monotonic() - start < 0.5


def test_a_hung_node_ends_in_unavailable_at_the_deadline_not_a_hang(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, _ = _store(count=2)
    for node in ("n00", "n01", "n02"):  # in every group
        nodes[node].delay_s = 5.0
    start = time.monotonic()
    got = read_objects(pool, codec, nodes, refs, 0.3, hedge_factor=2.0)  # type: ignore[arg-type]
    assert all(isinstance(r, ObjectUnavailable) for r in got)
    assert time.monotonic() - start < 0.6


def test_reads_route_around_a_node_that_failed(pool: ThreadPoolExecutor) -> None:
    """A failed stream marks its node avoided; the next read asks a parity shard in place of
    each shard it holds, from the start, and does not ask it at all."""
    codec, nodes, refs, datas = _store()
    health = NodeHealth(base_s=60.0, max_s=60.0)
    nodes["n04"].down = True
    opts = {"hedge_factor": 50.0, "hedge_min_s": 1.0, "health": health}
    # a pool of its own, joined: the first read returns once every object is decoded, and its
    # hedge's straggling streams must not count among the second read's asks
    with ThreadPoolExecutor(32) as first:
        assert read_objects(first, codec, nodes, refs, 2.0, **opts) == datas  # type: ignore[arg-type]
    assert health.avoided() == {"n04"} and health.failures("n04") == 1
    for node in nodes.values():
        node.asked.clear()
    start = time.monotonic()
    assert read_objects(pool, codec, nodes, refs, 2.0, **opts) == datas  # type: ignore[arg-type]
    assert time.monotonic() - start < 0.5
    assert nodes["n04"].asked == []
    asked = sum(len(n.asked) for n in nodes.values())
    assert asked == len(refs) * K  # k shards per object, no hedge round
    nodes["n04"].down = False  # back: once its back-off has passed, a read tries it again
    health = NodeHealth(base_s=0.01)
    health.failed("n04")
    time.sleep(0.02)
    opts["health"] = health
    assert read_objects(pool, codec, nodes, refs, 2.0, **opts) == datas  # type: ignore[arg-type]
    assert nodes["n04"].asked and health.failures("n04") == 0


def test_first_shards_prefers_data_then_parity_on_nodes_not_avoided() -> None:
    group = tuple(f"n{i:02d}" for i in range(K + M))
    assert first_shards(group, K, frozenset()) == list(range(K))
    assert first_shards(group, K, {"n03", "n07"}) == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert first_shards(group, K, {"n00", "n01", "n02"}) == [0, *range(3, K + M)]  # too few others


def test_a_read_that_fails_marks_only_the_nodes_that_failed_it(pool: ThreadPoolExecutor) -> None:
    codec, nodes, refs, _ = _store(count=1)
    health = NodeHealth()
    for node in refs[0].nodes[:3]:
        nodes[node].down = True
    (got,) = read_objects(pool, codec, nodes, refs, 1.0, hedge_factor=2.0, health=health)  # type: ignore[arg-type]
    assert isinstance(got, ObjectUnavailable)
    deadline = time.monotonic() + 2.0  # the answering streams may still be finishing
    while health.avoided() != set(refs[0].nodes[:3]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.avoided() == set(refs[0].nodes[:3])


def test_a_check_all_fraction_of_one_reads_every_shard_and_reports_bad_parity(
    pool: ThreadPoolExecutor,
) -> None:
    codec, nodes, refs, datas = _store()
    settled: dict[int, set[int]] = {}
    parity_node = refs[0].nodes[K + 1]
    nodes[parity_node].corrupt = {(refs[0].object_id, K + 1)}
    got = read_objects(pool, codec, nodes, refs, 2.0, settled.__setitem__, hedge_factor=50.0,
                       hedge_min_s=1.0, check_all_fraction=1.0)  # type: ignore[arg-type]  # fmt: skip
    assert got == datas
    deadline = time.monotonic() + 2.0
    while 0 not in settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled[0] == {K + 1}  # the rotted parity shard, queued for repair
    assert sum(len(n.asked) for n in nodes.values()) == len(refs) * (K + M)
