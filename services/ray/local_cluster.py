"""A Ray instance that listens on loopback only.

Ray binds every interface by default (see ShadowRay). Setting
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` together with ``_node_ip_address=127.0.0.1`` keeps
every Ray listener (GCS, raylet, workers, object manager) on 127.0.0.1; the integration
tests verify this with ``ss -ltnp``. Ray's token authentication stays on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services import envs

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def init_local_ray(
    num_cpus: int = 2,
    resources: Mapping[str, float] | None = None,
    namespace: str = "sluice",
) -> Any:
    """Start (or join) a local Ray instance bound to 127.0.0.1; returns ray's context."""
    # Ray reads this when `ray` is imported, here and in every worker it starts; workers
    # inherit it from our environment.
    envs.export_to_children(LOOPBACK_ENV)
    import ray  # imported lazily: nothing starts at import time
    from ray._private import ray_constants

    # If `ray` was imported before the variable was set, the constant is already stale.
    ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        return ray.get_runtime_context()
    return ray.init(
        address="local",  # always a new instance: never join one a RAY_ADDRESS points to
        num_cpus=num_cpus,
        resources=dict(resources or {}),
        include_dashboard=False,
        namespace=namespace,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
