"""Fixtures shared by every test layer: real services on loopback, generated checkpoints."""

from __future__ import annotations

import os

# One intra-op thread per test process (inherited by the servers and Ray workers tests start):
# the test models are tiny, so a second thread only adds synchronisation (test_llm.py: 43.6 s
# with torch's default 2 threads, 37.9 s with 1), and `make test` runs two pytest workers on
# two cores, where two threads each would contend. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from services.local.procs import RedisProcess  # noqa: E402

# `make test` runs two pytest-xdist workers. Each test file is one unit of work (its module
# fixtures are built once), except that every file whose tests start a Ray cluster (the
# session's `ray_local`, or their own through `sluice serve --config` / `ray start`) is in one
# unit, so two clusters never share this machine's cores.
_RAY_PATHS = ("tests/integration/ray/", "tests/integration/sites/")
_RAY_FILES = frozenset(
    {
        "tests/integration/services/test_local_services.py",
        "tests/unit/services/test_bench_e2e.py",
        "tests/unit/services/test_bench_handoff.py",
    }
)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _work_unit(nodeid: str) -> str:
    path = _file_of(nodeid)
    return "ray" if path.startswith(_RAY_PATHS) or path in _RAY_FILES else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; the GPU host has no xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class _PerFileRayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return _PerFileRayTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes `ray_local` outside the Ray unit would start a second cluster."""
    stray = sorted(
        {
            _file_of(i.nodeid)
            for i in items
            if "ray_local" in getattr(i, "fixturenames", ()) and _work_unit(i.nodeid) != "ray"
        }
    )
    if stray:
        raise pytest.UsageError(f"tests/conftest.py: add {stray} to _RAY_FILES (they start Ray)")


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
