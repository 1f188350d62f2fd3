"""The shared fixtures start real services, and they listen on loopback only."""

import os

import pytest
import redis

from tests.conftest import listening_sockets

pytestmark = pytest.mark.integration

LOOPBACK_PREFIXES = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:", "localhost:")


def _pids_of_tree(root: int) -> set[int]:
    """``root`` and every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, []))
    return seen


def _sockets_of(pids: set[int]) -> list[str]:
    addrs = []
    for addr, proc in listening_sockets():
        if any(f"pid={pid}," in proc for pid in pids):
            addrs.append(addr)
    return addrs


def test_redis_fixture_is_real_and_loopback_only(redis_server, redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    assert client.info("server")["redis_version"]
    addrs = _sockets_of({redis_server.proc.pid})
    assert addrs, "redis-server should be listening"
    assert all(a.startswith(LOOPBACK_PREFIXES) for a in addrs), addrs


def test_ray_listens_on_loopback_only(ray_local):
    import ray

    @ray.remote(resources={"prefill": 1})
    def square(x: int) -> int:
        return x * x

    assert ray.get(square.remote(7), timeout=60) == 49  # a worker really ran
    # every process Ray started (GCS, raylet, workers, agents) is a descendant of this one
    pids = _pids_of_tree(os.getpid()) - {os.getpid()}
    addrs = _sockets_of(pids)
    assert len(addrs) >= 3, f"expected Ray's GCS, raylet and workers to listen: {addrs}"
    exposed = [a for a in addrs if not a.startswith(LOOPBACK_PREFIXES)]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"


def test_ray_has_the_pool_resources(ray_local):
    import ray

    resources = ray.cluster_resources()
    for name in ("prefill", "decode", "ve", "store"):
        assert resources.get(name, 0) >= 1, name
