"""``sluice bench kvstore``: the erasure-coded KV store against its peers, in one run.

1. Codec: encode and decode (2 data shards missing) GB/s of our codec (ISA-L + shard
   headers + xxh3 checksums) against zfec, every pyeclib backend that loads, and np.copyto.
2. Store: put and get GB/s of 256 KiB, 1 MiB and 16 MiB objects through 12 real node
   processes on loopback (10+2, fsync on, metadata in a real Redis), against Redis SET/GET
   of the same payloads (pipelined, the fastest way to move a batch through Redis).
3. Degraded reads with 2 nodes killed, as a ratio of healthy reads in the same run.
4. Latency of single-block get_prefix: p50 and p99 (reads hedge over all 12 shards).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from typing import Any

from services.bench import Report, progress
from services.bench._kvstore_codec import peer_names, run_codec

KiB, MiB = 1 << 10, 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=12, help="store nodes on loopback")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--m", type=int, default=2)
    p.add_argument(
        "--sizes", default="262144,1048576,16777216", help="object sizes in bytes, comma-separated"
    )
    p.add_argument("--bytes-per-size", type=int, default=64 * MiB, help="bytes moved per size and direction")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per store figure (best is kept)")
    p.add_argument("--codec-rounds", type=int, default=5, help="interleaved timed rounds per codec figure")
    p.add_argument("--codec-min-time", type=float, default=0.2, help="seconds per codec timing round")
    p.add_argument("--latency-samples", type=int, default=200, help="single-block reads for p50/p99")
    p.add_argument("--latency-size", type=int, default=1 * MiB, help="object size for the latency figures")
    p.add_argument("--no-fsync", action="store_true", help="nodes skip fsync (not the default)")
    p.add_argument(
        "--hedge-factor", type=float, default=None,
        help="read the k data shards first, parity after a failure or this many times the fastest "
        "node's time (default: ask all k+m shards at once)",
    )  # fmt: skip
    p.add_argument(
        "--group-bytes", type=int, default=1 * MiB,
        help="put_blocks codes consecutive blocks together up to this many bytes per object (0: one "
        "object per block)",
    )  # fmt: skip
    p.add_argument("--node-cache", type=int, default=256 * MiB, help="each node's hot cache, bytes (0: off)")
    p.add_argument(
        "--only",
        choices=("all", "codec", "store"),
        default="all",
        help="run only the codec part or only the store part (targets of the other part are omitted)",
    )


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _best(rounds: int, fn: Any) -> float:
    return min(_timed(fn) for _ in range(rounds))


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _redis_figures(url: str, size: int, count: int, rounds: int) -> dict[str, float]:
    import redis

    r = redis.Redis.from_url(url)
    payloads = [os.urandom(size) for _ in range(count)]
    keys = [f"bench:{size}:{i}" for i in range(count)]

    def put() -> None:
        pipe = r.pipeline(transaction=False)
        for k, v in zip(keys, payloads):
            pipe.set(k, v)
        pipe.execute()

    def get() -> None:
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        if got[-1] != payloads[-1]:
            raise RuntimeError("redis returned wrong bytes")

    t_put = _best(rounds, put)
    t_get = _best(rounds, get)
    r.delete(*keys)
    r.close()
    return {"put_GBps": _rate(size * count, t_put), "get_GBps": _rate(size * count, t_get)}


def _store_figures(client: Any, size: int, count: int, rounds: int) -> tuple[dict[str, float], list[bytes]]:
    payloads = [os.urandom(size) for _ in range(count)]
    t_put = []
    keys: list[bytes] = []
    metas: list[Any] = []

    def put(keys: list[bytes]) -> None:
        metas[:] = client.put_blocks(keys, payloads, "chat")

    for _ in range(rounds):  # every round writes fresh blocks (put_blocks skips cached ones)
        keys = [os.urandom(32) for _ in range(count)]
        t_put.append(_timed(lambda keys=keys: put(keys)))
    got: list[bytes] = []

    def get() -> None:
        got[:] = client.get_prefix(keys)

    t_get = [_timed(get) for _ in range(rounds)]  # the first read finds the nodes' caches cold
    if got != payloads:
        raise RuntimeError(f"store returned wrong bytes for {size}-byte objects")
    return {
        "put_GBps": _rate(size * count, min(t_put)),
        "get_GBps": _rate(size * count, min(t_get)),
        "get_first_round_GBps": _rate(size * count, t_get[0]),
        "objects": len({m.object_id for m in metas}),  # erasure-coded objects the blocks became
    }, keys


def _latency(client: Any, size: int, samples: int) -> dict[str, float]:
    keys = [os.urandom(32) for _ in range(min(samples, 64))]
    client.put_blocks(keys, [os.urandom(size) for _ in keys], "chat")
    lat = []
    for i in range(samples):
        lat.append(_timed(lambda i=i: client.get_prefix([keys[i % len(keys)]])))
    lat.sort()
    return {
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "samples": samples,
    }


def run(args: argparse.Namespace) -> Report:
    from kvstore.client import StoreClient, StoreClientConfig
    from kvstore.cluster import LocalClusterConfig, LocalStoreCluster
    from kvstore.codec import CodecConfig
    from kvstore.memtune import tune_malloc
    from kvstore.redis_directory import RedisDirectory
    from services.procs import RedisProcess, free_port

    sizes = [int(s) for s in args.sizes.split(",")]
    config = {k: v for k, v in vars(args).items() if k != "func"}
    report = Report("kvstore", config)
    # Process-wide, so the Redis client measured here gets the same allocator settings.
    report.results["malloc_tuned"] = tune_malloc()
    if args.only in ("all", "codec"):
        progress("codec: ours vs zfec, pyeclib backends, memcpy")
        codec = run_codec(
            [1 * MiB, 16 * MiB], args.k, args.m, args.codec_min_time, args.codec_rounds, progress
        )
        report.results["codec"] = codec
    if args.only == "codec":
        _targets(report, [])
        return report
    store: dict[str, Any] = {}
    report.results["store"] = store
    # redis-py parses replies in Python unless hiredis is installed; say which one ran.
    report.results["redis_client_parser"] = "hiredis" if importlib.util.find_spec("hiredis") else "python"
    # Concurrency, stated for both sides: Sluice is one get_prefix/put_blocks call from one
    # thread (the client opens one stream per node inside it); Redis is one connection with
    # one pipeline per batch, from one thread.
    report.results["concurrency"] = {
        "store": "1 caller thread; 1 gRPC stream per node per batch inside the client",
        "redis": "1 caller thread; 1 connection; 1 pipeline per batch",
    }
    cluster_cfg = LocalClusterConfig(
        nodes=args.nodes, capacity_bytes=8 << 30, fsync=not args.no_fsync, cache_bytes=args.node_cache
    )
    with RedisProcess(port=free_port()) as redis_srv, LocalStoreCluster(cluster_cfg) as cluster:
        progress(f"{args.nodes} store nodes up; redis on {redis_srv.url}")
        ccfg = StoreClientConfig(
            nodes=cluster.nodes, codec=CodecConfig(k=args.k, m=args.m), hedge_factor=args.hedge_factor,
            group_bytes=args.group_bytes,
        )  # fmt: skip
        with StoreClient(ccfg, RedisDirectory(redis_srv.url)) as client:
            keys_by_size = {}
            for size in sizes:
                count = max(4, args.bytes_per_size // size)
                progress(f"store put/get {size >> 10} KiB x {count}")
                ours, keys_by_size[size] = _store_figures(client, size, count, args.rounds)
                peer = _redis_figures(redis_srv.url, size, count, args.rounds)
                store[str(size)] = {"store": ours, "redis": peer, "count": count}
                progress(f"  store put {ours['put_GBps']:.3f} get {ours['get_GBps']:.3f} GB/s; "
                         f"redis set {peer['put_GBps']:.3f} get {peer['get_GBps']:.3f} GB/s")  # fmt: skip
            progress(f"latency: {args.latency_samples} single-block reads of {args.latency_size >> 10} KiB")
            report.results["latency"] = _latency(client, args.latency_size, args.latency_samples)
            degraded: dict[str, Any] = {}
            report.results["degraded"] = degraded
            cluster.kill(0)
            cluster.kill(1)
            progress("degraded: nodes n00 and n01 killed")
            for size in sizes:
                keys = keys_by_size[size]
                t = _best(args.rounds, lambda keys=keys: client.get_prefix(keys))
                degraded[str(size)] = {"get_GBps": _rate(size * len(keys), t)}
                degraded[str(size)]["ratio"] = (
                    degraded[str(size)]["get_GBps"] / store[str(size)]["store"]["get_GBps"]
                )
                progress(f"  degraded get {size >> 10} KiB: {degraded[str(size)]['get_GBps']:.3f} GB/s")
    _targets(report, sizes)
    return report


def _targets(report: Report, sizes: list[int]) -> None:
    res = report.results
    for size_key, row in res.get("codec", {}).items():
        peers = {k: v for k, v in row.items() if k in peer_names(row)}
        best_enc = max(v["encode_GBps"] for v in peers.values())
        best_dec = max(v["decode2_GBps"] for v in peers.values())
        mib = int(size_key) >> 20
        report.target(
            f"codec_encode_GBps / best_peer_encode_GBps ({mib} MiB)",
            row["sluice"]["encode_GBps"] / best_enc,
            ">=",
            1.0,
        )
        report.target(
            f"codec_decode2_GBps / best_peer_decode2_GBps ({mib} MiB)",
            row["sluice"]["decode2_GBps"] / best_dec,
            ">=",
            1.0,
        )
    for size in sizes:
        row = res["store"][str(size)]
        label = f"{size >> 10} KiB"
        report.target(
            f"store_get_GBps / redis_get_GBps ({label})",
            row["store"]["get_GBps"] / row["redis"]["get_GBps"],
            ">=",
            1.0,
        )
        report.target(
            f"degraded_get_GBps / healthy_get_GBps ({label})", res["degraded"][str(size)]["ratio"], ">=", 0.8
        )
        report.rows.append({
            "size": label, "put_GBps": row["store"]["put_GBps"], "get_GBps": row["store"]["get_GBps"],
            "redis_set_GBps": row["redis"]["put_GBps"], "redis_get_GBps": row["redis"]["get_GBps"],
            "degraded_get_GBps": res["degraded"][str(size)]["get_GBps"],
        })  # fmt: skip
    if "latency" not in res:
        return
    lat = res["latency"]
    report.target("get_p99_ms / get_p50_ms", lat["p99_ms"] / lat["p50_ms"], "<=", 2.0)
