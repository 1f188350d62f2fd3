"""uvicorn settings that are part of the API's limits, and a server on a background thread.

The HTTP parser is pinned to h11 so that ``h11_max_incomplete_event_size`` bounds the
request line plus headers (a request past it gets uvicorn's 400 before the app runs;
between ``max_header_bytes`` and that bound, the guard middleware answers 431 naming the
limit). httptools, if installed, has no such bound.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from services.api.config import ApiConfig

HEADER_PARSER_FACTOR = 2  # h11's hard bound = factor x max_header_bytes


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (IPv6 for a host with ``:``);
    port 0 takes a free port, which ``getsockname()`` then names. Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, cfg: ApiConfig, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http="h11",
        h11_max_incomplete_event_size=HEADER_PARSER_FACTOR * cfg.max_header_bytes,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=5,
        # SIGTERM drains: the listener closes at once (new requests go to another replica)
        # and requests in flight may finish, as long as a request may run at all
        timeout_graceful_shutdown=int(cfg.request_timeout_s) + 1,
        server_header=False,
    )


class ServerThread:
    """Run a uvicorn server on a daemon thread (tests, benchmarks); a context manager."""

    def __init__(
        self, app: Any, cfg: ApiConfig, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ):
        self.host = host
        self.port = port
        self.server = uvicorn.Server(uvicorn_config(app, cfg, host, port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="sluice-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the API server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"API server not started after {timeout_s}s")
            time.sleep(0.02)
        if self.port == 0:
            sock = self.server.servers[0].sockets[0]
            self.port = int(sock.getsockname()[1])
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain as SIGTERM does, for half of ``timeout_s``; then end what is still open."""
        self.server.should_exit = True
        self.thread.join(timeout_s / 2)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout_s / 2)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
