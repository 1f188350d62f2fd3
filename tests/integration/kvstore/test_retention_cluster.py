"""Storage-side TTL per traffic class, the LRU collector and the scrubber, on 12 real nodes
with small capacities and a scrub pass every 0.3 s, metadata in a real Redis. The TTL and
scrub tests share a cluster with short TTLs; the LRU test has its own, whose TTLs no run
outlasts, so that only the collector removes what it wrote (with 3 s TTLs a slow machine
expired the first objects before the later ones filled a node, and no node had to evict)."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import StoreClient, StoreClientConfig
from kvstore.cluster import LocalClusterConfig, LocalStoreCluster
from kvstore.redis_directory import RedisDirectory
from kvstore.shardfmt import HEADER_LEN
from tests.integration.kvstore.helpers import node_index, shard_path

pytestmark = pytest.mark.integration
TTL = {"agent": 1.0, "chat": 3.0}
LONG_TTL = {"agent": 3600.0, "chat": 3600.0}
CAPACITY = 2 << 20


def _cluster(root: Path, ttl_s: dict[str, float]) -> LocalStoreCluster:
    cfg = LocalClusterConfig(
        nodes=12, capacity_bytes=CAPACITY, ttl_s=ttl_s, high_watermark=0.9, low_watermark=0.7,
        sweep_interval_s=0.2, metrics=True, scrub_bytes_per_s=64 << 20, scrub_period_s=0.3,
        scrub_first_after_s=0.0,
    )  # fmt: skip
    return LocalStoreCluster(cfg, root=root)


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStoreCluster]:
    with _cluster(Path(tmp_path_factory.mktemp("small")), TTL) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def lru_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStoreCluster]:
    with _cluster(Path(tmp_path_factory.mktemp("lru")), LONG_TTL) as cluster:
        yield cluster


def _client(cluster: LocalStoreCluster, redis_url: str, ttl_s: dict[str, float]) -> StoreClient:
    cfg = StoreClientConfig(nodes=cluster.nodes, ttl_s=ttl_s, background_repair=False)
    return StoreClient(cfg, RedisDirectory(redis_url))


@pytest.fixture()
def client(small_cluster: LocalStoreCluster, redis_url: str) -> Iterator[StoreClient]:
    with _client(small_cluster, redis_url, TTL) as c:
        yield c


@pytest.fixture()
def lru_client(lru_cluster: LocalStoreCluster, redis_url: str) -> Iterator[StoreClient]:
    with _client(lru_cluster, redis_url, LONG_TTL) as c:
        yield c


def _node_stats(client: StoreClient) -> list:
    return [t.stats(2.0) for t in client.transports.values()]


def test_ttl_expires_agent_before_chat_on_nodes_and_directory(client: StoreClient) -> None:
    agent = [os.urandom(32) for _ in range(3)]
    chat = [os.urandom(32) for _ in range(3)]
    pa, pc = [os.urandom(5000) for _ in agent], [os.urandom(5000) for _ in chat]
    client.put_blocks(agent, pa, "agent")
    client.put_blocks(chat, pc, "chat")
    expired_before = sum(s.expired_shards for s in _node_stats(client))
    metas = [client.directory.get(k) for k in agent]
    time.sleep(1.6)
    assert client.get_prefix(agent, touch=False) == []
    assert client.get_prefix(chat, touch=False) == pc
    # Expired on the storage side too, not only in the directory.
    objects = {m.object_id for m in metas if m is not None}  # the 3 blocks are one block group
    assert len(objects) == 1
    assert sum(s.expired_shards for s in _node_stats(client)) - expired_before == 12 * len(objects)
    for meta in metas:
        assert meta is not None
        for i, node in enumerate(meta.nodes):
            with pytest.raises(Exception, match="NOT_FOUND"):
                client.transports[node].get_shard(meta.object_id, i, 2.0)
    time.sleep(1.8)
    assert client.get_prefix(chat, touch=False) == []


def test_lru_keeps_usage_under_capacity_and_hot_objects_survive(
    lru_cluster: LocalStoreCluster, lru_client: StoreClient
) -> None:
    client = lru_client
    hot = [os.urandom(32) for _ in range(3)]
    hot_data = [os.urandom(1 << 20) for _ in hot]
    client.put_blocks(hot, hot_data, "chat")
    cold = []
    for _ in range(50):  # 50 MiB of objects over 12 x 2 MiB of capacity
        key = os.urandom(32)
        client.put_object(key, os.urandom(1 << 20), "chat")
        cold.append(key)
        assert client.get_prefix(hot) == hot_data  # hot: read (and touched) all along
        assert all(s.used_bytes <= CAPACITY for s in _node_stats(client))
    stats = dict(zip(client.transports, _node_stats(client)))
    assert all(s.evicted_shards > 0 for s in stats.values())
    # The hot objects were read 50 times, data first: each node holding one of their data
    # shards served it from its hot cache after the first read, and no cache holds anything
    # its node has evicted.
    serving = {
        node for m in client.directory.lookup_many(hot) if m for node in m.nodes[: client.codec.config.k]
    }
    assert all(stats[node].cache_hits > 0 for node in serving)
    assert all(s.cache_used_bytes <= s.used_bytes for s in stats.values())
    readable = sum(len(client.get_prefix([k], touch=False)) for k in cold)
    assert 0 < readable < len(cold)
    assert client.get_prefix(hot) == hot_data
    port = lru_cluster.metrics_ports[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    evicted = [ln for ln in text.splitlines() if ln.startswith("sluice_store_evicted_shards ")]
    assert evicted and float(evicted[0].split()[1]) > 0
    assert "sluice_store_used_bytes" in text and 'sluice_store_ops_total{op="put",outcome="ok"}' in text
    hits = [ln for ln in text.splitlines() if ln.startswith("sluice_store_cache_hits ")]
    assert hits and float(hits[0].split()[1]) > 0


def test_the_scrubber_drops_a_rotted_shard_nobody_read_and_a_read_repairs_it(
    small_cluster: LocalStoreCluster, redis_url: str
) -> None:
    cfg = StoreClientConfig(nodes=small_cluster.nodes, ttl_s=TTL, background_repair=True)
    with StoreClient(cfg, RedisDirectory(redis_url)) as c:
        key, data = os.urandom(32), os.urandom(50_000)
        meta = c.put_object(key, data)
        path = shard_path(small_cluster, meta, 6)
        good = path.read_bytes()
        path.write_bytes(good[:HEADER_LEN] + bytes([good[HEADER_LEN] ^ 1]) + good[HEADER_LEN + 1 :])
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:  # never read: only the scrubber looks
            time.sleep(0.05)
        assert not path.exists()
        port = small_cluster.metrics_ports[node_index(meta.nodes[6])]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "sluice_store_scrub_corrupt_shards 1.0" in text
        assert c.get_prefix([key], touch=False) == [data]  # NOT_FOUND there: parity steps in
        while not (path.exists() and path.read_bytes() == good) and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert path.read_bytes() == good  # the client's repair wrote it back
