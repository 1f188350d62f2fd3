"""``sluice serve --config FILE`` for the Ray modes: the stack a cluster spec describes.

``local-cluster``: a Ray instance on this host bound to 127.0.0.1 (``init_local_ray``) with
the pools' resources, and the KV store started here (its nodes and a Redis directory as
loopback processes, ``services.local.store.LocalStore``) for the server's lifetime.
``ray-cluster``: the Ray cluster at ``--ray-address`` (``ray.init(address=...)``; "auto"
finds a local head), and the store named by ``--store FILE`` (its nodes run where the
operator put them). ``two-datacenters``: the same, with each pool placed on the hosts that
advertise its datacentre (``dc:<name>``) and handoffs over gRPC between the two
(``services.ray.handoff``).

Either way: the engine actors of both pools (``services.ray.serving.RayServingClient``, the
router in this process), then the API on the socket already bound. SIGTERM or Ctrl-C stop
the API, then the actors, the store and a Ray instance this process started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import uvicorn

from kvstore.spec import StoreSpec
from services.api.server import uvicorn_config
from services.ray.cluster_spec import ClusterPlan, ClusterSpec, PoolPlan, derive

log = logging.getLogger("sluice.serve")
SERVED_MODES = ("local-cluster", "ray-cluster", "two-datacenters")


def pool_config(plan: PoolPlan, kv_store: str | None) -> Any:
    """The ``PoolConfig`` of one pool of the plan: its instances and EP ranks, their
    ``EngineConfig`` fields (the checkpoint is passed apart) and the Ray resources of a rank."""
    from services.ray.serving import PoolConfig

    lay = plan.layout
    engine = {k: v for k, v in plan.engine.items() if k != "model"}
    if kv_store is not None:
        engine["kv_store"] = kv_store
        # engines with a host slot pool share their slots through the store's Redis
        directory = StoreSpec.load(Path(kv_store)).directory
        if engine.get("host_swa_bytes") and directory != "memory":
            engine["swa_directory"] = directory
    resources = dict(lay.resources_per_rank)
    cpus = float(resources.pop("CPU", 0.0))
    eplb = asdict(plan.eplb) if plan.eplb.enabled and lay.expert_parallel > 1 else None
    return PoolConfig(lay.instances, engine, resources, cpus, expert_parallel=lay.expert_parallel, eplb=eplb)


def vision_config(plan: ClusterPlan) -> Any:
    """The ``PoolConfig`` of the plan's vision pool (None without one): its instances and
    the Ray resources of each (one ``ve`` per GPU; on CPU one CPU slot and one ``ve``). The
    encoders run on the pool's device, at the prefill engines' dtype (the rows' on the wire)."""
    from services.ray.serving import PoolConfig

    lay = plan.vision
    if lay.instances == 0:
        return None
    resources = dict(lay.resources_per_rank)
    cpus = float(resources.pop("CPU", 0.0))
    device = "cuda" if lay.gpus_per_rank else "cpu"
    dtype = plan.prefill.engine.get("dtype", "float32")
    return PoolConfig(lay.instances, {"device": device, "dtype": dtype}, resources, cpus)


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
    config_path: Path | None = None,
    attach: str | None = None,
) -> int:
    """Run the stack of ``spec`` until SIGTERM / Ctrl-C (see the module doc). ``attach``:
    this process is an API replica of that deployment (see ``start_api_replicas``)."""
    import ray

    from services.api.app import create_app
    from services.ray.local_cluster import init_local_ray
    from services.ray.serving import RayServingClient

    if spec.mode not in SERVED_MODES:
        raise ValueError(f"mode {spec.mode!r} is not served by `sluice serve` yet")
    plan = derive(spec)
    if spec.mode != "local-cluster" and store_spec is None:
        raise ValueError(
            f"mode {spec.mode}: name the KV store's spec with --store FILE (its nodes run elsewhere)"
        )
    if attach is not None:
        return _serve_api_replica(spec, cfg, sock, host, model, attach, ray_address, store_spec)
    store = None
    started_ray = False
    replicas: list[subprocess.Popen[bytes]] = []
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
            vision=vision_config(plan),
            handoff=plan.handoff,
        )
        app = create_app(cfg, client)
        port = sock.getsockname()[1]
        log.info(
            "serving %s on http://%s:%d: %s prefill and %s decode engine(s) on Ray, %s vision encoder(s), "
            "KV store %s, %d API replica(s)",
            model, host, port, plan.prefill.layout.instances, plan.decode.layout.instances,
            plan.vision.instances, store_spec, spec.api.replicas,
        )  # fmt: skip
        if spec.api.replicas > 1:
            if config_path is None:
                raise ValueError("api.replicas > 1 needs the spec's path, for the other API processes")
            gcs = ray.get_runtime_context().gcs_address
            replicas = start_api_replicas(
                spec.api.replicas - 1, config_path, client.deployment, gcs, sock, model, store_spec
            )
        _FrontServer(uvicorn_config(app, cfg, host, port), replicas, cfg.request_timeout_s).run(
            sockets=[sock]
        )
        return 0
    finally:
        _stop_replicas(replicas, 10.0)
        if started_ray or ray.is_initialized():
            ray.shutdown()
        if store is not None:
            store.stop()


def start_api_replicas(
    n: int,
    config_path: Path,
    deployment: str,
    gcs_address: str,
    sock: Any,
    model: Path,
    store_spec: str | None,
) -> list[subprocess.Popen[bytes]]:
    """``n`` more API processes serving on the same listening socket (inherited; the kernel
    hands each new connection to one of them). Each is a Ray driver of the same cluster that
    follows this deployment's engine actors by name with its own router, fed by its own
    watch streams (``EngineActor.watch``'s subscriber), so no process routes blind; decode
    reservations are made on the engines, so the processes never oversubscribe one."""
    cmd = [
        sys.executable, "-m", "services.cli", "serve", "--config", str(config_path), "--model", str(model),
        "--attach", deployment, "--ray-address", gcs_address, "--api-fd", str(sock.fileno()),
    ]  # fmt: skip
    if store_spec is not None:
        cmd += ["--store", str(store_spec)]
    return [subprocess.Popen(cmd, pass_fds=[sock.fileno()]) for _ in range(n)]


def _stop_replicas(replicas: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for p in replicas:
        if p.poll() is None:
            p.terminate()
    for p in replicas:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _FrontServer(uvicorn.Server):
    """The first API process: SIGTERM / Ctrl-C reach the other API replicas at once (they
    drain too), and the engines are stopped (the app's shutdown) only after they have
    ended, so no replica loses its engines mid-request."""

    def __init__(
        self, config: uvicorn.Config, replicas: list[subprocess.Popen[bytes]], drain_s: float
    ) -> None:
        super().__init__(config)
        self.replicas, self.drain_s = replicas, drain_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        for p in self.replicas:
            if p.poll() is None:
                p.send_signal(sig)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if not self.replicas:
            return
        shutdown = self.lifespan.shutdown

        async def after_the_replicas() -> None:
            await asyncio.to_thread(_stop_replicas, self.replicas, self.drain_s + 5.0)
            await shutdown()

        self.lifespan.shutdown = after_the_replicas


def _serve_api_replica(
    spec: ClusterSpec, cfg: Any, sock: Any, host: str, model: Path, deployment: str,
    ray_address: str | None, store_spec: str | None,
) -> int:  # fmt: skip
    """One more API process of ``deployment`` (see ``start_api_replicas``)."""
    import ray

    from services.api.app import create_app
    from services.ray.serving import RayServingClient

    plan = derive(spec)
    ray.init(address=ray_address or "auto", namespace="sluice", log_to_driver=False)
    try:
        client = RayServingClient(
            model,
            pool_config(plan.prefill, store_spec),
            pool_config(plan.decode, store_spec),
            policy=plan.router.policy,
            deployment=deployment,
            attach=True,
            vision=vision_config(plan),
            handoff=plan.handoff,
        )
        app = create_app(cfg, client)
        log.info("API replica of deployment %s (pid %d)", deployment, os.getpid())
        uvicorn.Server(uvicorn_config(app, cfg, host, sock.getsockname()[1])).run(sockets=[sock])
        return 0
    finally:
        ray.shutdown()


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
