"""``LocalStoreCluster``: N storage node processes on loopback, started and torn down reliably.

Used by ``sluice store cluster``, the integration tests and the benchmark. Nodes start in
parallel: each binds port 0 and reports it through ``<data-dir>/node.addr`` (its metrics
port, if any, through ``metrics.addr``); readiness is the Health RPC. ``kill(i)`` is a real
SIGKILL; ``restart(i)`` brings the node back on the same ports and data directory, so it
serves its shards again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import kvstore
from kvstore.placement import NodeAddress
from kvstore.retention import DEFAULT_TTL_S


@dataclass(frozen=True)
class LocalClusterConfig:
    nodes: int = 12
    host: str = "127.0.0.1"  # the address every node binds and is reached at
    capacity_bytes: int = 1 << 30
    ttl_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL_S))
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    sweep_interval_s: float = 5.0
    fsync: bool = True
    metrics: bool = False
    start_timeout_s: float = 30.0
    cache_bytes: int = 256 << 20  # each node's hot cache of recently read shards; 0 is off
    scrub_bytes_per_s: int = 16 << 20  # each node's scrubber (kvstore.scrub); 0 is off
    scrub_period_s: float = 86400.0
    scrub_first_after_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 256:
            raise ValueError(f"--nodes must be within [1, 256], got {self.nodes}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0 (0 turns the cache off), got {self.cache_bytes}")


# Runs a module with this checkout's packages first on sys.path: argv is
# [root, proto dir, module, *module args]. No environment variable is read or set.
_BOOT = (
    "import runpy, sys; sys.path[:0] = sys.argv[1:3]; module = sys.argv[3]; "
    "sys.argv = [module, *sys.argv[4:]]; runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def checkout_paths() -> list[str]:
    """The import roots of the checkout this package was imported from (repo root, proto/)."""
    root = Path(kvstore.__file__).resolve().parent.parent
    return [str(root), str(root / "proto")]


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` that imports this checkout's code (a worktree, not whatever
    is installed), so child processes run the same code as the process that starts them."""
    return [sys.executable, "-c", _BOOT, *checkout_paths(), module, *args]


def _port_in(addr_file: Path) -> int:
    return int(addr_file.read_text().strip().rpartition(":")[2])


class LocalStoreCluster:
    """Context manager owning the node processes and (unless given) a temporary data root."""

    def __init__(self, config: LocalClusterConfig | None = None, root: Path | None = None) -> None:
        self.config = config or LocalClusterConfig()
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="sluice-store-")) if root is None else Path(root)
        self.node_ids = [f"n{i:02d}" for i in range(self.config.nodes)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * self.config.nodes
        self.ports: list[int] = [0] * self.config.nodes
        self.metrics_ports: list[int | None] = [None] * self.config.nodes

    def data_dir(self, i: int) -> Path:
        return self.root / self.node_ids[i]

    @property
    def nodes(self) -> tuple[NodeAddress, ...]:
        return tuple(
            NodeAddress(nid, f"{self.config.host}:{port}") for nid, port in zip(self.node_ids, self.ports)
        )

    def _spawn(self, i: int, port: int) -> subprocess.Popen[bytes]:
        c = self.config
        d = self.data_dir(i)
        d.mkdir(parents=True, exist_ok=True)
        for name in ("node.addr", "metrics.addr"):
            (d / name).unlink(missing_ok=True)
        args = [
            "--node-id", self.node_ids[i], "--host", c.host, "--port", str(port), "--data-dir", str(d),
            "--capacity", str(c.capacity_bytes),
            "--ttl-agent", str(c.ttl_s["agent"]), "--ttl-chat", str(c.ttl_s["chat"]),
            "--high-watermark", str(c.high_watermark), "--low-watermark", str(c.low_watermark),
            "--sweep-interval", str(c.sweep_interval_s), "--cache-bytes", str(c.cache_bytes),
            "--scrub-rate", str(c.scrub_bytes_per_s), "--scrub-period", str(c.scrub_period_s),
            "--scrub-first-after", str(c.scrub_first_after_s),
        ]  # fmt: skip
        if not c.fsync:
            args.append("--no-fsync")
        if c.metrics:  # the node binds it (0 the first time) and reports it: no port race
            args += ["--metrics-port", str(self.metrics_ports[i] or 0)]
        log = open(d / "node.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(
                module_command("kvstore.node", *args),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()

    def _await(self, indices: list[int]) -> None:
        from kvstore.transport import GrpcShardTransport

        deadline = time.monotonic() + self.config.start_timeout_s
        waiting = set(indices)
        while waiting:
            for i in sorted(waiting):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    log = (self.data_dir(i) / "node.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"store node {self.node_ids[i]} exited with {proc.returncode}:\n{log}")
                addr = self.data_dir(i) / "node.addr"
                if addr.exists():
                    self.ports[i] = _port_in(addr)
                    if self.config.metrics:
                        self.metrics_ports[i] = _port_in(self.data_dir(i) / "metrics.addr")
                    waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"store nodes {sorted(waiting)} not ready in {self.config.start_timeout_s}s"
                )
            if waiting:
                time.sleep(0.02)
        for i in indices:
            t = GrpcShardTransport(self.nodes[i])
            try:
                if not t.health(max(0.1, deadline - time.monotonic())):
                    raise TimeoutError(f"store node {self.node_ids[i]} does not report SERVING")
            finally:
                t.close()

    def start(self) -> LocalStoreCluster:
        try:
            for i in range(self.config.nodes):
                self.procs[i] = self._spawn(i, 0)
            self._await(list(range(self.config.nodes)))
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node i and reap it (no cleanup runs in the node)."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def restart(self, i: int) -> None:
        """Start node i again on its previous port and data directory."""
        self.kill(i)
        self.procs[i] = self._spawn(i, self.ports[i])
        self._await([i])

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs[i] = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalStoreCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
