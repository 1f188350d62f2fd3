"""``sluice store``: run one erasure-coded KV store node, or a local cluster of them.

``sluice store node --port 7000 --data-dir var/store/n00 --capacity 8GiB`` serves one node.
``sluice store cluster --nodes 12`` starts twelve nodes on loopback (``--host``: another
address) in the foreground,
prints their addresses and stops them all on Ctrl-C or SIGTERM. ``--redis`` also starts a
redis-server on loopback as the block directory; ``--spec-out FILE`` (which needs
``--redis``) writes the store spec (``kvstore.spec``) once every node is up, for other
processes (``sluice serve --store FILE``, the engine's KV connector), and removes it on exit.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from kvstore.nodecli import add_node_arguments, config_from_args, parse_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="run KV store nodes (one node, or a local cluster)")
    kinds = p.add_subparsers(dest="store_command", metavar="{node,cluster}")
    kinds.required = True
    node = kinds.add_parser("node", help="serve one store node (gRPC)")
    add_node_arguments(node)
    node.set_defaults(func=run_node)
    cluster = kinds.add_parser("cluster", help="start N store nodes on loopback (foreground)")
    cluster.add_argument("--nodes", type=int, default=12, help="number of nodes (>= k+m = 12 for 10+2)")
    cluster.add_argument(
        "--data-dir", type=Path, default=None, help="root for node data (default: temporary)"
    )
    cluster.add_argument("--capacity", type=parse_size, default=parse_size("1GiB"), help="bytes per node")
    cluster.add_argument("--metrics", action="store_true", help="serve Prometheus metrics on free ports")
    cluster.add_argument(
        "--host", default="127.0.0.1",
        help="the address the nodes and Redis bind (default loopback; another site's engines need "
        "an address they can reach: the nodes speak plain gRPC, so bind only a private network)",
    )  # fmt: skip
    cluster.add_argument(
        "--redis", action="store_true", help="also start a redis-server on loopback as the block directory"
    )
    cluster.add_argument(
        "--spec-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the store spec (JSON: nodes and directory) here once the nodes are up; needs --redis",
    )
    cluster.set_defaults(func=run_cluster)


def run_node(args: argparse.Namespace) -> int:
    from kvstore.nodecli import serve  # gRPC and the stubs load only in serve()

    return serve(config_from_args(args))


def run_cluster(args: argparse.Namespace) -> int:
    from kvstore.cluster import LocalClusterConfig
    from services.local.store import LocalStore

    spec_out: Path | None = args.spec_out
    if spec_out is not None:
        if not args.redis:
            raise ValueError(
                "--spec-out needs --redis: the spec names the block directory, and other processes "
                "cannot share this process's in-memory one"
            )
        if not spec_out.parent.is_dir():
            raise ValueError(f"--spec-out {spec_out}: directory {spec_out.parent} does not exist")
    cfg = LocalClusterConfig(
        nodes=args.nodes, host=args.host, capacity_bytes=args.capacity, metrics=args.metrics
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    with LocalStore(cfg, spec_path=spec_out, root=args.data_dir, redis=args.redis) as store:
        cluster = store.cluster
        for i, node in enumerate(cluster.nodes):
            extra = f" metrics http://{args.host}:{cluster.metrics_ports[i]}/metrics" if args.metrics else ""
            print(f"{node.node_id} {node.address} data {cluster.data_dir(i)}{extra}", flush=True)
        if store.redis is not None:
            shown = (
                store.redis.url.replace(f":{store.redis.password}@", ":***@")
                if store.redis.password
                else store.redis.url
            )
            print(f"directory {shown}", flush=True)  # the password is in the 0600 spec file only
        if spec_out is not None:
            print(f"spec {spec_out}", flush=True)
        print(f"{len(cluster.nodes)} store nodes up; Ctrl-C stops them", flush=True)
        done.wait()
    return 0
