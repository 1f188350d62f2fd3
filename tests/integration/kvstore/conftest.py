"""Fixtures for the store integration tests: 12 real node processes on loopback, and clients
that keep metadata in a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import StoreClient, StoreClientConfig
from kvstore.cluster import LocalClusterConfig, LocalStoreCluster
from kvstore.redis_directory import RedisDirectory


@pytest.fixture(scope="module")
def store_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStoreCluster]:
    """Twelve store nodes for the module (default retention: TTL 3/7 days, 1 GiB each)."""
    root = tmp_path_factory.mktemp("store")
    with LocalStoreCluster(LocalClusterConfig(nodes=12, capacity_bytes=2 << 30), root=Path(root)) as cluster:
        yield cluster


@pytest.fixture()
def live_cluster(store_cluster: LocalStoreCluster) -> Iterator[LocalStoreCluster]:
    """The module's cluster with every node up before and after the test."""
    for i in range(store_cluster.config.nodes):
        if not store_cluster.alive(i):
            store_cluster.restart(i)
    yield store_cluster
    for i in range(store_cluster.config.nodes):
        if not store_cluster.alive(i):
            store_cluster.restart(i)


def make_client(cluster: LocalStoreCluster, redis_url: str, **overrides: object) -> StoreClient:
    settings: dict[str, object] = {"background_repair": False, **overrides}
    cfg = StoreClientConfig(nodes=cluster.nodes, **settings)  # type: ignore[arg-type]
    client = StoreClient(cfg, RedisDirectory(redis_url))
    assert all(client.health_check(5.0).values())
    return client


@pytest.fixture()
def store_client(live_cluster: LocalStoreCluster, redis_url: str) -> Iterator[StoreClient]:
    """A client of the live cluster with a Redis directory; repair runs when the test asks."""
    client = make_client(live_cluster, redis_url)
    yield client
    client.close()
