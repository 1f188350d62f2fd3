"""A store node's command line (``python -m kvstore.node``, ``sluice store node``): its
arguments, and ``serve``, which runs a node until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.retention import DAY_S, RetentionConfig

if TYPE_CHECKING:
    from kvstore.node import NodeConfig

MiB = 1 << 20


def parse_size(text: str) -> int:
    """``123``, ``64KiB``, ``512MiB``, ``2GiB`` (also K/M/G) -> bytes."""
    units = {
        "kib": 1 << 10,
        "k": 1 << 10,
        "mib": 1 << 20,
        "m": 1 << 20,
        "gib": 1 << 30,
        "g": 1 << 30,
        "tib": 1 << 40,
    }
    low = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * units[suffix])
    return int(low)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-id", default=None, help="stable node id used by placement (default: node-<port>)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    p.add_argument("--data-dir", type=Path, required=True, help="directory for shard files")
    p.add_argument("--capacity", type=parse_size, default=parse_size("1GiB"), help="bytes, e.g. 512MiB")
    p.add_argument("--ttl-agent", type=float, default=3 * DAY_S, help="seconds an agent shard lives unused")
    p.add_argument("--ttl-chat", type=float, default=7 * DAY_S, help="seconds a chat shard lives unused")
    p.add_argument("--high-watermark", type=float, default=0.90, help="usage fraction that starts LRU GC")
    p.add_argument("--low-watermark", type=float, default=0.80, help="usage fraction LRU GC frees down to")
    p.add_argument("--sweep-interval", type=float, default=5.0, help="seconds between TTL/LRU sweeps")
    p.add_argument("--max-shard-bytes", type=parse_size, default=64 * MiB, help="largest shard accepted")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (0: any free port)",
    )
    p.add_argument(
        "--cache-bytes", type=parse_size, default=256 * MiB,
        help="in-memory cache of recently read shards, e.g. 256MiB; 0 turns it off",
    )  # fmt: skip
    p.add_argument(
        "--scrub-rate", type=parse_size, default=16 * MiB,
        help="bytes per second the scrubber re-reads and checks shard files, e.g. 16MiB; 0 turns it off",
    )  # fmt: skip
    p.add_argument("--scrub-period", type=float, default=86400.0, help="seconds between scrub pass starts")
    p.add_argument(
        "--scrub-first-after", type=float, default=600.0, help="seconds from start to the first scrub pass"
    )
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (tests on tmpfs only; unsafe)")


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    from kvstore.node import NodeConfig  # gRPC is imported only when a node is built

    retention = RetentionConfig(
        ttl_s={"agent": args.ttl_agent, "chat": args.ttl_chat},
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
    )
    return NodeConfig(
        node_id=args.node_id or f"node-{args.port}", data_dir=args.data_dir, capacity_bytes=args.capacity,
        host=args.host, port=args.port, retention=retention, max_shard_bytes=args.max_shard_bytes,
        fsync=not args.no_fsync, sweep_interval_s=args.sweep_interval, metrics_port=args.metrics_port,
        cache_bytes=args.cache_bytes, scrub_bytes_per_s=args.scrub_rate, scrub_period_s=args.scrub_period,
        scrub_first_after_s=args.scrub_first_after,
    )  # fmt: skip


def serve(config: NodeConfig) -> int:
    from kvstore.memtune import tune_malloc
    from kvstore.node import StoreNodeServer

    tune_malloc()  # this process is a node: keep shard-sized buffers for reuse
    config.data_dir.mkdir(parents=True, exist_ok=True)
    node = StoreNodeServer(config).start()
    logging.getLogger("kvstore.node").info(
        "store node %s serving on %s (data %s)", config.node_id, node.address, config.data_dir
    )
    print(f"store node {config.node_id} listening on {node.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvstore import node

    parser = argparse.ArgumentParser(prog="python -m kvstore.node", description=node.__doc__)
    add_node_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config_from_args(args))
