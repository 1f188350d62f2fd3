"""``sluice serve --config FILE`` for the Ray modes: the stack a cluster spec describes.

``local-cluster``: a Ray instance on this host bound to 127.0.0.1 (``init_local_ray``) with
the pools' resources, and the KV store started here (its nodes and a Redis directory as
loopback processes, ``services.local.store.LocalStore``) for the server's lifetime.
``ray-cluster``: the Ray cluster at ``--ray-address`` (``ray.init(address=...)``; "auto"
finds a local head), and the store named by ``--store FILE`` (its nodes run where the
operator put them).

Either way: the engine actors of both pools (``services.ray.serving.RayServingClient``, the
router in this process), then the API on the socket already bound. SIGTERM or Ctrl-C stop
the API, then the actors, the store and a Ray instance this process started.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.ray.cluster_spec import ClusterPlan, ClusterSpec, PoolPlan, derive

log = logging.getLogger("sluice.serve")
SERVED_MODES = ("local-cluster", "ray-cluster")


def pool_config(plan: PoolPlan, kv_store: str | None) -> Any:
    """The ``PoolConfig`` of one pool of the plan: its instances and EP ranks, their
    ``EngineConfig`` fields (the checkpoint is passed apart) and the Ray resources of a rank."""
    from services.ray.serving import PoolConfig

    lay = plan.layout
    engine = {k: v for k, v in plan.engine.items() if k != "model"}
    if kv_store is not None:
        engine["kv_store"] = kv_store
    resources = dict(lay.resources_per_rank)
    cpus = float(resources.pop("CPU", 0.0))
    eplb = asdict(plan.eplb) if plan.eplb.enabled and lay.expert_parallel > 1 else None
    return PoolConfig(lay.instances, engine, resources, cpus, expert_parallel=lay.expert_parallel, eplb=eplb)


def local_ray_resources(plan: ClusterPlan) -> tuple[int, dict[str, float]]:
    """(CPUs, custom resources) a local Ray instance needs to place the plan's engines."""
    need = plan.resources()
    cpus = int(-(-need.pop("CPU", 0.0) // 1))
    need.pop("GPU", None)  # Ray detects GPUs itself
    return max(cpus, 1), need


def serve_cluster(
    spec: ClusterSpec,
    cfg: Any,
    sock: Any,
    host: str,
    model: Path,
    *,
    ray_address: str | None = None,
    store_spec: str | None = None,
) -> int:
    """Run the stack of ``spec`` until SIGTERM / Ctrl-C (see the module doc)."""
    import ray
    import uvicorn

    from services.api.app import create_app
    from services.api.server import uvicorn_config
    from services.ray.local_cluster import init_local_ray
    from services.ray.serving import RayServingClient

    if spec.mode not in SERVED_MODES:
        raise ValueError(f"mode {spec.mode!r} is not served by `sluice serve` yet")
    plan = derive(spec)
    if spec.mode == "ray-cluster" and store_spec is None:
        raise ValueError(
            "mode ray-cluster: name the KV store's spec with --store FILE (its nodes run elsewhere)"
        )
    store = None
    started_ray = False
    try:
        if spec.mode == "local-cluster":
            store = _start_local_store(plan)
            store_spec = str(store.spec_path)
            cpus, resources = local_ray_resources(plan)
            cpus = max(cpus, os.cpu_count() or 1)
            init_local_ray(num_cpus=cpus, resources=resources)
            started_ray = True
        else:
            ray.init(address=ray_address or "auto", namespace="sluice", log_to_driver=False)
        client = RayServingClient(
            model,
            pool_config(plan.prefill, store_spec),
            pool_config(plan.decode, store_spec),
            policy=plan.router.policy,
        )
        app = create_app(cfg, client)
        port = sock.getsockname()[1]
        log.info(
            "serving %s on http://%s:%d: %s prefill and %s decode engine(s) on Ray, KV store %s",
            model, host, port, plan.prefill.layout.instances, plan.decode.layout.instances, store_spec,
        )  # fmt: skip
        uvicorn.Server(uvicorn_config(app, cfg, host, port)).run(sockets=[sock])
        return 0
    finally:
        if started_ray or ray.is_initialized():
            ray.shutdown()
        if store is not None:
            store.stop()


def _start_local_store(plan: ClusterPlan) -> Any:
    """The plan's store on loopback: its nodes, the spec's Redis (``redis_url``) or one
    started here, and a spec file with the plan's code and TTLs (``spec_path``)."""
    from kvstore.cluster import LocalClusterConfig
    from services.local.store import LocalStore

    st = plan.store
    own_redis = not st.directory
    log.info(
        "starting the KV store: %d nodes (%d+%d) on loopback, directory %s",
        len(st.node_ids), st.k, st.m, "a redis-server started here" if own_redis else "the spec's redis_url",
    )  # fmt: skip
    cluster = LocalClusterConfig(
        nodes=len(st.node_ids), capacity_bytes=st.node_capacity_bytes, ttl_s=dict(st.ttl_s)
    )
    store = LocalStore(cluster, redis=own_redis, directory=None if own_redis else st.directory).start()
    try:
        assert store.spec is not None and store.spec_path is not None  # a directory: a spec was written
        spec = st.store_spec([n.address for n in store.spec.nodes], store.spec.directory)
        store.spec = spec
        spec.save(store.spec_path)
    except BaseException:
        store.stop()
        raise
    return store
