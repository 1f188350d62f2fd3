"""Fixtures shared by every test layer: real services on loopback, generated checkpoints."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.local.procs import RedisProcess


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """A real redis-server on a free loopback port, for the whole session."""
    with RedisProcess() as server:
        yield server


@pytest.fixture()
def redis_url(redis_server: RedisProcess) -> Iterator[str]:
    """A Redis URL on an empty database: flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    yield redis_server.url


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """A Ray local cluster bound to 127.0.0.1 only, with Sluice's pool resources."""
    import ray

    from services.ray.local_cluster import init_local_ray

    ctx = init_local_ray(num_cpus=2, resources={"prefill": 4, "decode": 4, "ve": 1, "store": 1})
    yield ctx
    ray.shutdown()


def listening_sockets(pids: set[int] | None = None) -> list[tuple[str, str]]:
    """(local address, process description) for every listening TCP socket, from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            rows.append((parts[3], " ".join(parts[5:])))
    return rows


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    """Generate (once per session and arguments) a random DeepSeek-V4 checkpoint directory."""
    from engine.checkpoint.generate import generate_checkpoint

    cache: dict[tuple, Path] = {}

    def make(preset: str = "tiny", seed: int = 0, **overrides: object) -> Path:
        key = (preset, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{preset}-{seed}")
            generate_checkpoint(preset, out, seed=seed, **overrides)
            cache[key] = out
        return cache[key]

    return make
