"""``sluice serve --store local``: the embedded store (12 nodes + redis-server) lives exactly as
long as the server, whichever way the server ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.serve_proc import ServeProcess
from tests.integration.services.procutil import command_line, command_lines, descendants, wait_gone

pytestmark = pytest.mark.integration
_STORE_LINE = re.compile(r"with KV store (\S+) \((\d+) nodes")
_NODE_ID = re.compile(r"kvstore\.node .*--node-id (\S+)")


def _node_ids(lines: list[str]) -> set[str]:
    """Store node ids among command lines (a node's own children, if any, repeat its id)."""
    return {m.group(1) for c in lines if (m := _NODE_ID.search(c))}


def _store_children(pid: int, timeout_s: float = 20.0) -> set[int]:
    """The server's 12 store nodes and redis-server, once all are up."""
    deadline = time.monotonic() + timeout_s
    while True:
        kids = descendants(pid)
        lines = command_lines(kids)
        if len(_node_ids(lines)) == 12 and any("redis-server" in c for c in lines):
            return kids
        assert time.monotonic() < deadline, f"store processes not all up: {lines}"
        time.sleep(0.05)


def _wait_for_line(server: ServeProcess, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        for line in list(server.lines):
            if m := pattern.search(line):
                return m
        assert time.monotonic() < deadline, f"no line matching {pattern.pattern!r}:\n{server.output()}"
        time.sleep(0.05)


def test_serve_store_local_answers_then_stops_the_store_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    env = {"SLUICE_HOME": str(tmp_path), "SLUICE_LOG_LEVEL": "INFO"}
    server = ServeProcess(["--model", str(tiny_model), "--store", "local"], env, timeout_s=30)
    try:
        kids = _store_children(server.proc.pid)
        server.wait_until_ready("/health", timeout_s=25)
        m = _wait_for_line(server, _STORE_LINE, 5)
        spec = Path(m.group(1))
        assert m.group(2) == "12" and spec.is_file()
    finally:
        server.stop()
    assert server.returncode in (0, -signal.SIGTERM), server.output()
    assert wait_gone(kids, 10) == set(), command_lines(kids)
    assert not spec.exists() and not spec.parent.exists()


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_sigterm_at_any_point_stops_the_local_store(tmp_path: Path) -> None:
    """Independent of the engine: the server part is replaced by a wait for SIGTERM."""
    driver = (
        "import sys, time\n"
        "from services.commands import serve\n"
        "def hold(*a, **k):\n"
        "    print('STORE', k.get('store_note') or a[-1], flush=True)\n"
        "    time.sleep(60)\n"
        "serve._serve = hold\n"
        "from services.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["serve", "--port", "0", "--model", str(tmp_path), "--store", "local"]
    proc = subprocess.Popen(
        [sys.executable, "-c", driver, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("STORE"):
            line = proc.stdout.readline()
        m = _STORE_LINE.search(line)
        assert m, line
        kids = _store_children(proc.pid)
        spec = Path(m.group(1))
        assert spec.is_file()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        assert proc.returncode == -signal.SIGTERM  # as a server without a store ends on SIGTERM
        assert wait_gone(kids, 10) == set(), command_lines(kids)
        assert not spec.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes on 2 cores
def test_a_server_that_fails_to_start_stops_the_local_store(tmp_path: Path) -> None:
    """A model directory that is not a checkpoint: the server exits 2, and the store it had
    started is gone (watched from outside while it ran, then found nowhere by its data path)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "tmp").mkdir()
    args = ["serve", "--port", "0", "--model", str(tmp_path / "model"), "--store", "local"]
    env = {**os.environ, "SLUICE_HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    seen: dict[int, str] = {}
    while proc.poll() is None:  # every process the server starts, while it runs
        for pid in descendants(proc.pid):
            if line := command_line(pid):
                seen[pid] = line
        time.sleep(0.01)
    out = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert proc.returncode == 2 and "not a checkpoint directory" in out, out
    assert len(_node_ids(list(seen.values()))) == 12, seen
    assert any("redis-server" in c for c in seen.values()), seen
    assert wait_gone(set(seen), 10) == set(), command_lines(set(seen))
    assert list((tmp_path / "tmp").iterdir()) == []  # node data and the spec's directory removed
