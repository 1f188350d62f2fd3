"""``sluice store node`` and ``sluice store cluster`` as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.cluster import module_command
from kvstore.placement import NodeAddress
from kvstore.transport import GrpcShardTransport

pytestmark = pytest.mark.integration


def _wait_line(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line.strip())
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not printed; got {lines}")


def test_store_cluster_command_starts_and_stops_all_nodes(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        module_command("services.cli", "store", "cluster", "--nodes", "3", "--data-dir", str(tmp_path)),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = _wait_line(proc, "store nodes up", 30)
        addrs = [ln.split()[1] for ln in lines if ln.startswith("n0")]
        assert len(addrs) == 3 and all(a.startswith("127.0.0.1:") for a in addrs)
        for i, addr in enumerate(addrs):
            t = GrpcShardTransport(NodeAddress(f"n{i:02d}", addr))
            assert t.health(5.0)
            t.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        for addr in addrs:  # every node is gone
            t = GrpcShardTransport(NodeAddress("x", addr))
            assert not t.health(0.3)
            t.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_store_node_rejects_bad_capacity(tmp_path: Path) -> None:
    out = subprocess.run(
        module_command("services.cli", "store", "node", "--data-dir", str(tmp_path), "--capacity", "0"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 2 and "--capacity must be positive" in out.stderr
    assert os.listdir(tmp_path) == []
