"""``sluice store cluster --redis --spec-out FILE`` as a user runs it, and ``LocalStore``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.cluster import LocalClusterConfig, module_command
from kvstore.spec import StoreSpec, open_store_client
from services.local.store import LocalStore
from tests.integration.services.procutil import command_lines, descendants, wait_gone

pytestmark = pytest.mark.integration


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}: {proc.communicate()[0]!r}"
        assert time.monotonic() < deadline, f"{path} not written within {timeout_s} s"
        time.sleep(0.05)


def test_store_cluster_writes_a_usable_spec_and_cleans_up(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    cmd = ["store", "cluster", "--nodes", "12", "--redis", "--spec-out", str(spec_file)]
    cmd += ["--data-dir", str(tmp_path / "data"), "--capacity", "64MiB"]
    proc = subprocess.Popen(
        module_command("services.cli", *cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_for(spec_file, proc, 25)
        spec = StoreSpec.load(spec_file)
        assert len(spec.nodes) == 12 and spec.directory.startswith("redis://127.0.0.1:")
        kids = descendants(proc.pid)
        assert len(kids) >= 13, command_lines(kids)  # 12 nodes and redis-server
        assert any("redis-server" in c for c in command_lines(kids))
        with open_store_client(spec, background_repair=False) as client:
            hashes, payloads = [os.urandom(32), os.urandom(32)], [os.urandom(70_000), b"x"]
            client.put_blocks(hashes, payloads)
            assert [bytes(v) for v in client.get_prefix(hashes)] == payloads
        with open_store_client(StoreSpec.load(spec_file)) as other:  # a second client sees the blocks
            assert [bytes(v) for v in other.get_prefix_async(hashes).result(10)] == payloads
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert b"12 store nodes up" in out and f"spec {spec_file}".encode() in out
        assert not spec_file.exists()
        assert wait_gone(kids) == set(), command_lines(kids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_spec_out_without_redis_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cmd = ["store", "cluster", "--spec-out", str(tmp_path / "spec.json"), "--data-dir", str(tmp_path / "d")]
    out = subprocess.run(module_command("services.cli", *cmd), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--spec-out needs --redis" in out.stderr and "in-memory" in out.stderr
    assert list(tmp_path.iterdir()) == []
    cmd = ["store", "cluster", "--redis", "--spec-out", str(tmp_path / "no" / "spec.json")]
    out = subprocess.run(module_command("services.cli", *cmd), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_local_store_context_manager(tmp_path: Path) -> None:
    cfg = LocalClusterConfig(nodes=12, capacity_bytes=64 << 20)
    with LocalStore(cfg, root=tmp_path / "data") as store:
        assert store.spec_path is not None and store.spec_path.is_file()
        assert StoreSpec.load(store.spec_path) == store.spec
        pids = set(store.pids())
        assert len(pids) == 13
        spec_path = store.spec_path
    assert not spec_path.exists() and not spec_path.parent.exists()  # the temporary directory too
    assert wait_gone(pids, 5) == set()


def test_local_store_failing_to_start_stops_what_it_started(tmp_path: Path) -> None:
    store = LocalStore(LocalClusterConfig(nodes=12), spec_path=tmp_path / "missing" / "spec.json")
    with pytest.raises(FileNotFoundError):
        store.start()
    assert store.pids() == [] and store.redis is not None and store.redis.proc is None
