"""Twelve real store nodes on loopback, a real Redis directory, 10+2 erasure coding."""

from __future__ import annotations

import itertools
import os
import time

import pytest

from kvstore.client import StoreClient, WriteFailed
from kvstore.cluster import LocalStoreCluster
from kvstore.shardfmt import HEADER_LEN, Shard
from tests.integration.kvstore.conftest import make_client
from tests.integration.kvstore.helpers import Load, expect_unavailable_fast, node_index, shard_path

pytestmark = pytest.mark.integration  # the tests with wall-clock bounds are marked `timing`
KiB, MiB = 1 << 10, 1 << 20
# Shard boundaries of 10+2: multiples of k, of ISA-L's 16-byte alignment x k, and block sizes.
BOUNDARIES = [10, 160, 40 * KiB, 256 * KiB, 1 * MiB, 16 * MiB]
SIZES = sorted({1, 2} | {b + d for b in BOUNDARIES for d in (-1, 0, 1)})


def test_round_trip_1_byte_to_64_mib_at_every_shard_boundary(store_client: StoreClient) -> None:
    keys, datas = [], []
    for size in [*SIZES, 64 * MiB]:
        key, data = os.urandom(32), os.urandom(size)
        meta = store_client.put_object(key, data, "chat")
        assert meta.present == 0xFFF and meta.size == size
        keys.append(key)
        datas.append(data if size < 64 * MiB else None)
        if size == 64 * MiB:  # read the big one now, do not keep it in memory
            assert store_client.get_prefix([key])[0] == data
            del data
    got = store_client.get_prefix(keys[:-1])
    assert len(got) == len(SIZES)
    assert all(g == d for g, d in zip(got, datas))


def test_prefix_semantics_longest_contiguous_run(store_client: StoreClient) -> None:
    chain = [os.urandom(32) for _ in range(6)]
    payloads = [os.urandom(3000 + i) for i in range(6)]
    store_client.put_blocks(chain[:4], payloads[:4], "agent")
    assert store_client.get_prefix(chain) == payloads[:4]
    assert store_client.get_prefix(chain[1:3]) == payloads[1:3]
    assert store_client.get_prefix([os.urandom(32), *chain]) == []
    metas = store_client.put_blocks(chain, payloads, "agent")  # only the two new blocks are written
    assert len(metas) == 2
    assert store_client.get_prefix(chain) == payloads
    assert store_client.touch(chain) == 6
    assert store_client.delete(chain[2:3]) == 1
    assert store_client.get_prefix(chain) == payloads[:2]


def _kill_pair_under_load(
    cluster: LocalStoreCluster, client: StoreClient, pair: tuple[int, int], seed: int
) -> Load:
    load = Load(client, seed=seed)

    def kill() -> None:
        cluster.kill(pair[0])
        cluster.kill(pair[1])

    load.run(1.2, kill)
    assert not load.unexpected, load.unexpected[:3]
    assert not load.wrong, f"wrong bytes for {load.wrong[:3]}"
    assert load.reads > 0 and len(load.written) > 0
    load.check_all_readable()  # still with both nodes down
    return load


def test_any_two_nodes_killed_under_load_one_pair(live_cluster: LocalStoreCluster, redis_url: str) -> None:
    client = make_client(live_cluster, redis_url)
    try:
        load = _kill_pair_under_load(live_cluster, client, (3, 8), seed=1)
        assert load.write_failures > 0  # 10 of 12 shards < k+1: writes fail loudly meanwhile
        with pytest.raises(WriteFailed, match="10 of 12 shards durable, need 11"):
            client.put_object(os.urandom(32), b"x" * 1000)
    finally:
        client.close()


@pytest.mark.slow
def test_all_66_pairs_of_nodes_killed_under_load(live_cluster: LocalStoreCluster, redis_url: str) -> None:
    client = make_client(live_cluster, redis_url)
    try:
        for n, pair in enumerate(itertools.combinations(range(12), 2)):
            _kill_pair_under_load(live_cluster, client, pair, seed=n)
            for i in pair:
                live_cluster.restart(i)
            assert all(client.health_check(5.0).values())
    finally:
        client.close()


@pytest.mark.timing
def test_third_node_down_is_an_explicit_error_within_a_second(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    keys = [os.urandom(32) for _ in range(3)]
    datas = [os.urandom(200_000) for _ in keys]
    store_client.put_blocks(keys, datas)
    for i in (0, 5, 9):
        live_cluster.kill(i)
    for _ in range(3):
        assert expect_unavailable_fast(store_client, keys) < 1.0
    start = time.monotonic()
    with pytest.raises(WriteFailed, match="9 of 12 shards durable, need 11"):
        store_client.put_object(os.urandom(32), os.urandom(100_000))
    assert time.monotonic() - start < 1.0
    live_cluster.restart(0)
    assert store_client.transports["n00"].health(5.0)
    assert store_client.get_prefix(keys) == datas  # back to 10 nodes: readable again


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param({3: "flip"}, id="bitflip-1"),
        pytest.param({0: "flip", 11: "truncate"}, id="flip+truncate"),
        pytest.param({4: "extend", 7: "header"}, id="extend+header"),
    ],
)
def test_corrupt_shards_are_detected_read_correctly_and_repaired(
    live_cluster: LocalStoreCluster, store_client: StoreClient, damage: dict[int, str]
) -> None:
    key, data = os.urandom(32), os.urandom(700_001)
    meta = store_client.put_object(key, data)
    originals = {i: shard_path(live_cluster, meta, i).read_bytes() for i in damage}
    for i, kind in damage.items():
        path = shard_path(live_cluster, meta, i)
        raw = bytearray(originals[i])
        if kind == "flip":
            raw[HEADER_LEN + len(raw) // 3] ^= 0x20
        elif kind == "header":
            raw[40] ^= 0x01
        elif kind == "truncate":
            raw = raw[:-17]
        else:
            raw += b"\x00extra"
        path.write_bytes(bytes(raw))
    assert store_client.get_prefix([key], touch=False) == [data]
    deadline = time.monotonic() + 5
    while store_client.repair.pending() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # stragglers report the bad shards once they settle
    assert store_client.repair.run_pending() == len(damage)
    for i in damage:
        assert shard_path(live_cluster, meta, i).read_bytes() == originals[i]
        Shard.parse(originals[i])
    # Every shard on disk is good again, so any two other nodes can go.
    live_cluster.kill(node_index(meta.nodes[1]))
    live_cluster.kill(node_index(meta.nodes[2]))
    assert store_client.get_prefix([key], touch=False) == [data]


@pytest.mark.parametrize("index", range(12))
def test_node_killed_mid_write_leaves_object_whole_or_absent(
    live_cluster: LocalStoreCluster, redis_url: str, index: int
) -> None:
    client = make_client(live_cluster, redis_url, chunk_bytes=64 * KiB)
    try:
        key, data = os.urandom(32), os.urandom(2 * MiB + index)
        group = client.group(key)
        victim = node_index(group[index])
        short = index % 2 == 1  # odd indices: another node is already down, so quorum fails
        if short:
            live_cluster.kill(node_index(group[(index + 1) % 12]))
        killed = []

        def progress(shard: int, sent: int) -> None:
            if shard == index and not killed:
                killed.append(sent)
                live_cluster.kill(victim)

        if short:
            with pytest.raises(WriteFailed):
                client.put_object(key, data, progress=progress)
            assert client.get_prefix([key]) == []
            assert client.directory.get(key) is None
        else:
            meta = client.put_object(key, data, progress=progress)
            assert meta.present == 0xFFF & ~(1 << index)
            assert client.get_prefix([key], touch=False) == [data]
        assert killed and killed[0] < 210_000  # killed after the first chunk of ~210 KB
        live_cluster.restart(victim)
        if not short:
            client.health_check(5.0)
            assert client.repair.run_pending() == 1
            assert shard_path(live_cluster, client.directory.get(key), index).exists()  # type: ignore[arg-type]
    finally:
        client.close()


def test_restarted_node_serves_its_shards_again(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    keys = [os.urandom(32) for _ in range(5)]
    datas = [os.urandom(100_000 + i) for i in range(5)]
    store_client.put_blocks(keys, datas)
    live_cluster.kill(0)
    torn = live_cluster.data_dir(0) / "shards" / "a" / ("ab" * 16 + ".03")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"SLKV" + bytes(30))  # a write torn by a crash
    live_cluster.restart(0)
    live_cluster.restart(1)
    assert all(store_client.health_check(5.0).values())
    stats = store_client.transports["n00"].stats(2.0)
    assert stats.discarded_at_start == 1 and not torn.exists()
    assert stats.shard_count >= 5
    live_cluster.kill(2)  # now shards on the restarted 0 and 1 are needed to reach k = 10
    live_cluster.kill(3)
    assert store_client.get_prefix(keys) == datas


_CLIENT_DIES = """
import os, sys
sys.path[:0] = sys.argv[1:3]  # this checkout's packages
del sys.argv[1:3]
from kvstore.client import StoreClient, StoreClientConfig
from kvstore.placement import NodeAddress
from kvstore.redis_directory import RedisDirectory
nodes = tuple(NodeAddress(*a.split("=")) for a in sys.argv[3:])
client = StoreClient(StoreClientConfig(nodes=nodes, chunk_bytes=64 * 1024), RedisDirectory(sys.argv[1]))
def progress(index, sent):
    if index == 5 and sent > 64 * 1024:
        os._exit(17)  # the client process dies in the middle of its write
client.put_object(bytes.fromhex(sys.argv[2]), os.urandom(4 << 20), progress=progress)
"""


def test_client_killed_mid_write_leaves_object_absent(
    live_cluster: LocalStoreCluster, store_client: StoreClient, redis_url: str
) -> None:
    import subprocess
    import sys

    from kvstore.cluster import checkout_paths

    key = os.urandom(32)
    nodes = [f"{n.node_id}={n.address}" for n in live_cluster.nodes]
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT_DIES, *checkout_paths(), redis_url, key.hex(), *nodes], timeout=60
    )
    assert proc.returncode == 17
    assert store_client.directory.get(key) is None
    assert store_client.get_prefix([key]) == []


def test_batched_rpcs_report_each_shard(live_cluster: LocalStoreCluster, store_client: StoreClient) -> None:
    from kvstore.codec import new_object_id
    from kvstore.transport import ShardMissing, ShardRejectedByNode

    node = store_client.transports["n04"]
    good = [store_client.codec.encode(new_object_id(), os.urandom(n))[3] for n in (10, 300_000, 5)]
    bad = Shard(good[1].header, bytes(good[1].payload[:-1]) + bytes([good[1].payload[-1] ^ 1]))
    results = node.put_shards([good[0], bad, good[2]], 5.0)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ShardRejectedByNode) and "checksum" in str(results[1])
    replies: dict[int, object] = {}
    refs = [(s.header.object_id, 3) for s in good]
    node.get_shards(refs, 5.0, replies.update)
    assert replies[0].to_bytes() == good[0].to_bytes()  # type: ignore[attr-defined]
    assert isinstance(replies[1], ShardMissing)
    assert replies[2].to_bytes() == good[2].to_bytes()  # type: ignore[attr-defined]


@pytest.mark.timing
def test_hung_nodes_are_hedged_and_a_third_times_out_explicitly(
    live_cluster: LocalStoreCluster, redis_url: str
) -> None:
    import signal

    client = make_client(live_cluster, redis_url, read_timeout_s=1.0)
    stopped: list[int] = []
    try:
        keys = [os.urandom(32) for _ in range(4)]
        datas = [os.urandom(300_000) for _ in keys]
        client.put_blocks(keys, datas)
        for i in (2, 9):  # alive but frozen: connections open, no replies
            os.kill(live_cluster.procs[i].pid, signal.SIGSTOP)  # type: ignore[union-attr]
            stopped.append(i)
        start = time.monotonic()
        assert client.get_prefix(keys, touch=False) == datas  # the first 10 replies decode
        assert time.monotonic() - start < 1.0  # answered without waiting on the frozen two
        os.kill(live_cluster.procs[4].pid, signal.SIGSTOP)  # type: ignore[union-attr]
        stopped.append(4)
        assert expect_unavailable_fast(client, keys) < 1.5  # the 1 s deadline, not a hang
    finally:
        for i in stopped:
            os.kill(live_cluster.procs[i].pid, signal.SIGCONT)  # type: ignore[union-attr]
        client.close()


@pytest.mark.parametrize(("index", "check_all"), [(6, 0.01), (11, 1.0)])
def test_background_repair_restores_a_corrupt_shard(
    live_cluster: LocalStoreCluster, redis_url: str, index: int, check_all: float
) -> None:
    """A data shard that fails its checksum is found by any read; a parity shard by the
    reads that check every shard (``check_all_fraction``)."""
    client = make_client(live_cluster, redis_url, background_repair=True, check_all_fraction=check_all)
    try:
        key, data = os.urandom(32), os.urandom(123_457)
        meta = client.put_object(key, data)
        path = shard_path(live_cluster, meta, index)
        good = path.read_bytes()
        path.write_bytes(good[:HEADER_LEN] + bytes([good[HEADER_LEN] ^ 0xFF]) + good[HEADER_LEN + 1 :])
        assert client.get_prefix([key], touch=False) == [data]
        deadline = time.monotonic() + 10
        # the repair replaces the file, then counts the shard once the node has answered: the
        # file can be seen rewritten before the count
        while time.monotonic() < deadline and (_read(path) != good or client.repair.repaired_shards < 1):
            time.sleep(0.05)
        assert _read(path) == good
        assert client.repair.repaired_shards == 1
    finally:
        client.close()


def _read(path) -> bytes | None:
    """The file's bytes, or None while it is missing (between exists() and a read, a repair
    in progress may remove it: a race the test must not lose)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


@pytest.mark.timing
def test_redis_down_is_an_error_and_an_empty_redis_is_a_miss(live_cluster: LocalStoreCluster) -> None:
    import redis as redis_lib

    from kvstore.client import StoreClientConfig
    from kvstore.redis_directory import RedisDirectory
    from services.local.procs import RedisProcess

    server = RedisProcess().start()
    port = server.port
    client = StoreClient(
        StoreClientConfig(nodes=live_cluster.nodes), RedisDirectory(server.url, timeout_s=0.5)
    )
    try:
        keys = [os.urandom(32) for _ in range(3)]
        client.put_blocks(keys, [os.urandom(50_000) for _ in keys])
        server.stop()
        start = time.monotonic()
        with pytest.raises(redis_lib.exceptions.ConnectionError):
            client.get_prefix(keys)
        assert time.monotonic() - start < 2.0
        server = RedisProcess(port=port).start()  # metadata is gone (no persistence)
        assert client.get_prefix(keys) == []  # a cache miss, never wrong bytes
    finally:
        client.close()
        server.stop()


def test_a_data_first_read_refreshes_the_parity_shards_it_did_not_ask_for(
    live_cluster: LocalStoreCluster, store_client: StoreClient
) -> None:
    """Else the parity of a hot object would age out under LRU or TTL while its data lives."""
    key = os.urandom(32)
    meta = store_client.put_object(key, os.urandom(200_000))
    parity = [shard_path(live_cluster, meta, i) for i in (10, 11)]
    data = shard_path(live_cluster, meta, 3)
    written = [p.stat().st_mtime_ns for p in (*parity, data)]
    time.sleep(0.05)
    assert store_client.get_prefix([key])[0] is not None
    deadline = time.monotonic() + 5
    while any(p.stat().st_mtime_ns == w for p, w in zip(parity, written)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(p.stat().st_mtime_ns > w for p, w in zip(parity, written))  # touched (TouchShards)
    assert data.stat().st_mtime_ns == written[2]  # served: refreshed in the node's memory only
