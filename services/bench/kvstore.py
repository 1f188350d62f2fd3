"""``sluice bench kvstore``: the erasure-coded KV store against its peers, in one run.

1. Codec: encode and decode (2 data shards missing) GB/s of our codec (ISA-L + shard
   headers + xxh3 checksums) against zfec, every pyeclib backend that loads, and np.copyto.
2. Store: put and get GB/s of 256 KiB, 1 MiB and 16 MiB objects through 12 real node
   processes on loopback (10+2, fsync on, metadata in a real Redis), against Redis SET/GET
   of the same payloads (pipelined, the fastest way to move a batch through Redis).
3. Degraded reads with 2 nodes killed, as a ratio of healthy reads in the same run.
4. Latency of single-block get_prefix: p50 and p99 (reads data first, hedged by timer).

Timing on a shared machine: every get figure is the best of its rounds, and the rounds are
interleaved (a store get, then a Redis get of the same size, then the next size), in
``--cycles`` cycles of healthy rounds, 2 nodes killed, degraded rounds, the 2 restarted.
A slow moment of the machine then lands on both sides of a ratio, not on one.
"""

from __future__ import annotations

import argparse
import importlib.util

from services.bench import Report, progress
from services.bench._kvstore_codec import peer_names, run_codec
from services.bench._kvstore_store import run_store

KiB, MiB = 1 << 10, 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=12, help="store nodes on loopback")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--m", type=int, default=2)
    p.add_argument(
        "--sizes", default="262144,1048576,16777216", help="object sizes in bytes, comma-separated"
    )
    p.add_argument("--bytes-per-size", type=int, default=64 * MiB, help="bytes moved per size and direction")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per figure and cycle (best is kept)")
    p.add_argument(
        "--cycles", type=int, default=4,
        help="cycles of healthy rounds, 2 nodes killed, degraded rounds, nodes restarted",
    )  # fmt: skip
    p.add_argument(
        "--codec-seconds", type=float, default=20.0,
        help="seconds per object size of interleaved codec batches (all implementations in turn)",
    )  # fmt: skip
    p.add_argument("--codec-batch-ms", type=float, default=2.0, help="length of one timed codec batch")
    p.add_argument("--latency-samples", type=int, default=1000, help="single-block reads for p50/p99")
    p.add_argument("--latency-size", type=int, default=1 * MiB, help="object size for the latency figures")
    p.add_argument("--no-fsync", action="store_true", help="nodes skip fsync (not the default)")
    p.add_argument(
        "--hedge-factor", type=float, default=None,
        help="reads ask k shards first, the rest after a failure or this many times the fastest "
        "node's time; 0 asks all k+m shards at once (default: the client's)",
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


def run(args: argparse.Namespace) -> Report:
    from kvstore.client import StoreClient, StoreClientConfig
    from kvstore.cluster import LocalClusterConfig, LocalStoreCluster
    from kvstore.codec import CodecConfig
    from kvstore.memtune import tune_malloc
    from kvstore.redis_directory import RedisDirectory
    from services.local.procs import RedisProcess

    sizes = [int(s) for s in args.sizes.split(",")]
    config = {k: v for k, v in vars(args).items() if k != "func"}
    report = Report("kvstore", config)
    # Process-wide, so the Redis client measured here gets the same allocator settings.
    report.results["malloc_tuned"] = tune_malloc()
    if args.only in ("all", "codec"):
        progress("codec: ours vs zfec, pyeclib backends, memcpy")
        codec = run_codec(
            [1 * MiB, 16 * MiB], args.k, args.m, args.codec_seconds, args.codec_batch_ms / 1e3, progress
        )
        report.results["codec"] = codec
    if args.only == "codec":
        _targets(report, [])
        return report
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
    hedge = StoreClientConfig.hedge_factor if args.hedge_factor is None else args.hedge_factor or None
    report.results["hedge_factor"] = hedge  # None: every read asks all k+m shards at once
    with RedisProcess() as redis_srv, LocalStoreCluster(cluster_cfg) as cluster:
        progress(f"{args.nodes} store nodes up; redis on {redis_srv.url}")
        ccfg = StoreClientConfig(
            nodes=cluster.nodes, codec=CodecConfig(k=args.k, m=args.m), hedge_factor=hedge,
            group_bytes=args.group_bytes,
        )  # fmt: skip
        with StoreClient(ccfg, RedisDirectory(redis_srv.url)) as client:
            report.results.update(run_store(client, cluster, redis_srv.url, sizes, args, progress))
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
