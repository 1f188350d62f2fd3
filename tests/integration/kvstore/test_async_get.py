"""``StoreClient.get_prefix_async`` against 12 real nodes and a real Redis directory."""

from __future__ import annotations

import os
import threading

import pytest

from kvstore.client import StoreClient
from kvstore.cluster import LocalStoreCluster
from kvstore.fanout import ObjectUnavailable

pytestmark = pytest.mark.integration


def test_future_resolves_to_get_prefix_bytes_without_blocking(
    store_client: StoreClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = [os.urandom(32) for _ in range(6)]
    payloads = [os.urandom(n) for n in (1, 4095, 65_537, 300_001, 2 << 20, 17)]  # grouped and alone
    store_client.put_blocks(hashes, payloads)
    gate, read = threading.Event(), store_client.get_prefix

    def held_read(keys: list[bytes], touch: bool = True) -> list[memoryview]:
        assert gate.wait(10)
        return read(keys, touch)

    monkeypatch.setattr(store_client, "get_prefix", held_read)
    fut = store_client.get_prefix_async([*hashes, os.urandom(32)], touch=False)
    assert not fut.done()  # the caller got its future while the read is held
    gate.set()
    got = fut.result(timeout=10)
    monkeypatch.undo()
    assert [bytes(v) for v in got] == payloads
    assert [bytes(v) for v in store_client.get_prefix(hashes, touch=False)] == payloads
    assert {t.name.rpartition("_")[0] for t in threading.enumerate()} >= {"kv-get"}
    # concurrent futures, all answered
    futs = [store_client.get_prefix_async(hashes[: i + 1]) for i in range(len(hashes))]
    assert [len(f.result(timeout=10)) for f in futs] == list(range(1, 7))


def test_future_carries_object_unavailable_with_three_nodes_down(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    hashes = [os.urandom(32) for _ in range(3)]
    payloads = [os.urandom(100_000) for _ in hashes]
    store_client.put_blocks(hashes, payloads)
    for i in (0, 5, 11):  # 12 nodes, each object on all 12: 9 shards left of the 10 needed
        live_cluster.kill(i)
    fut = store_client.get_prefix_async(hashes, touch=False)
    with pytest.raises(ObjectUnavailable):
        fut.result(timeout=15)
    assert isinstance(fut.exception(), ObjectUnavailable)


def test_closing_the_client_stops_its_read_threads(live_cluster: LocalStoreCluster, redis_url: str) -> None:
    from tests.integration.kvstore.conftest import make_client

    client = make_client(live_cluster, redis_url)
    client.put_blocks([b"k" * 32], [b"v" * 1000])
    assert bytes(client.get_prefix_async([b"k" * 32]).result(timeout=10)[0]) == b"v" * 1000
    client.close()
    assert not any(t.name.startswith("kv-get") for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="shut down"):
        client.get_prefix_async([b"k" * 32])
