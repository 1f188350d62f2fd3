"""Block groups on 12 real store nodes and a real Redis: a chain's small blocks coded together."""

from __future__ import annotations

import os

import pytest

from kvstore.client import StoreClient, WriteFailed
from kvstore.cluster import LocalStoreCluster
from kvstore.directory import BlockMeta
from tests.integration.kvstore.conftest import make_client
from tests.integration.kvstore.helpers import node_index, shard_path

pytestmark = pytest.mark.integration
KiB, MiB = 1 << 10, 1 << 20


def chain_of(n: int, size: int = 256 * KiB) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def objects(metas: list[BlockMeta]) -> list[bytes]:
    return list(dict.fromkeys(m.object_id for m in metas))


def on_disk(cluster: LocalStoreCluster, meta: BlockMeta) -> int:
    return sum(shard_path(cluster, meta, i).exists() for i in range(len(meta.nodes)))


def test_grouped_chain_round_trips_and_prefixes_may_end_inside_a_group(store_client: StoreClient) -> None:
    chain, payloads = chain_of(10)
    metas = store_client.put_blocks(chain, payloads, "chat")
    assert len(metas) == 10 and len(objects(metas)) == 3  # 1 MiB groups: 4 + 4 + 2 blocks
    assert [(m.offset, m.length, m.size) for m in metas[4:8]] == [
        (i * 256 * KiB, 256 * KiB, MiB) for i in range(4)
    ]
    assert all(m.present == 0xFFF for m in metas)
    assert store_client.get_prefix(chain) == payloads
    assert store_client.get_prefix(chain[:6]) == payloads[:6]  # ends inside the second group
    assert store_client.get_prefix(chain[5:9]) == payloads[5:9]  # starts inside one
    assert store_client.get_prefix([*chain[:3], os.urandom(32), *chain[3:]]) == payloads[:3]
    assert store_client.touch(chain) == 10


def test_ungrouped_and_grouped_blocks_of_one_chain_read_together(
    live_cluster: LocalStoreCluster, redis_url: str, store_client: StoreClient
) -> None:
    chain, payloads = chain_of(7, 200 * KiB)
    with make_client(live_cluster, redis_url, group_bytes=0) as old:
        first = old.put_blocks(chain[:3], payloads[:3], "chat")
    assert not any(m.grouped for m in first) and len(objects(first)) == 3
    later = store_client.put_blocks(chain, payloads, "chat")  # only the 4 new blocks
    assert [m.key for m in later] == chain[3:] and all(m.grouped for m in later)
    assert len(objects(later)) == 1  # 800 KiB: one group
    assert store_client.get_prefix(chain) == payloads
    assert store_client.get_prefix(chain[2:5]) == payloads[2:5]


def test_deleting_blocks_of_a_group_frees_the_object_with_the_last(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    chain, payloads = chain_of(4)
    metas = store_client.put_blocks(chain, payloads, "agent")
    assert len(objects(metas)) == 1 and on_disk(live_cluster, metas[0]) == 12
    assert store_client.delete([chain[1]]) == 1
    assert store_client.get_prefix(chain) == payloads[:1]
    assert store_client.get_prefix(chain[2:]) == payloads[2:]
    assert on_disk(live_cluster, metas[0]) == 12  # three blocks still name the object
    assert store_client.delete([chain[0], chain[3]]) == 2
    assert store_client.get_prefix(chain[2:3]) == payloads[2:3] and on_disk(live_cluster, metas[0]) == 12
    assert store_client.delete(chain) == 1
    assert store_client.get_prefix(chain[2:]) == [] and on_disk(live_cluster, metas[0]) == 0
    # A hash repeated in one call is one row, so the object still goes with its last row.
    metas = store_client.put_blocks([chain[0], chain[1], chain[0]], [payloads[0], payloads[1], b"x"], "chat")
    assert [m.key for m in metas] == chain[:2] and store_client.get_prefix(chain[:2]) == payloads[:2]
    assert store_client.delete(chain[:2]) == 2 and on_disk(live_cluster, metas[0]) == 0


def test_grouped_chain_reads_with_two_nodes_of_each_group_killed(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    chain, payloads = chain_of(8)
    metas = store_client.put_blocks(chain, payloads, "chat")
    assert len(objects(metas)) == 2
    down = {node_index(metas[0].nodes[0]), node_index(metas[0].nodes[7])}
    for i in down:
        live_cluster.kill(i)
    touched = sum(any(node_index(n) in down for n in m.nodes) for m in metas[::4])
    assert touched >= 1
    assert store_client.get_prefix(chain, touch=False) == payloads
    assert store_client.get_prefix(chain[3:6], touch=False) == payloads[3:6]


def test_a_group_short_of_its_write_quorum_commits_none_of_its_blocks(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    chain, payloads = chain_of(6)
    live_cluster.kill(3)
    live_cluster.kill(9)  # 10 of 12 shards durable, the quorum is 11
    with pytest.raises(WriteFailed, match="6 of 6 blocks not stored"):
        store_client.put_blocks(chain, payloads, "chat")
    assert store_client.directory.lookup_many(chain) == [None] * 6
