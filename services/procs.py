"""Start and stop the local processes Sluice depends on (Redis), bound to loopback.

Used by `sluice` subcommands, benchmarks and the test fixtures alike, so every caller
gets the same hardened flags: loopback only, no persistence, protected mode on.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (racy by nature; callers retry on bind errors)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Block until something accepts TCP connections on (host, port); raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.1f}s") from None
            time.sleep(0.02)


def redis_server_binary() -> str:
    """Path of a real redis-server: PATH first, then the one the venv's PyPI wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.exists():
        return str(beside)
    raise FileNotFoundError("redis-server not found; run `make install` (Debian package or PyPI wheel)")


@dataclass
class RedisProcess:
    """A redis-server child process on 127.0.0.1. Use as a context manager or call stop()."""

    port: int
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        args = [
            redis_server_binary(),
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.host, self.port, timeout_s)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis(port: int | None = None) -> RedisProcess:
    return RedisProcess(port=port or free_port()).start()
