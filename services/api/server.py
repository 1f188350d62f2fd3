"""uvicorn settings that are part of the API's limits, and a server on a background thread.

The HTTP parser is pinned to h11 so that ``h11_max_incomplete_event_size`` bounds the
request line plus headers; httptools, if installed, has no such bound. Between
``max_header_bytes`` and that bound, the guard middleware answers 431 naming the limit.
Past the bound the request never reaches the app: `GuardedH11Protocol` answers it (431 for
headers too long, 400 for any other unparsable request, in the API's error shape), then
closes the connection lingering, so that the client reads the answer.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.api.config import ApiConfig
from services.api.errors import ApiError, error_bytes, limit_error

HEADER_PARSER_FACTOR = 2  # h11's hard bound = factor x max_header_bytes
LINGER_S = 2.0  # after refusing an unparsable request: how long its unread bytes are drained
LINGER_BYTES = 1 << 20  # ... and how many at most


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with its answer to a request h11 cannot parse changed.

    uvicorn answers a plain-text 400 and closes at once, with the rest of the request (a
    header past the parser's bound, a body) unread; the kernel then resets the connection,
    and the reset can overtake the answer, so that the client sees "connection reset" and
    no reason. Here the answer is 431 naming ``max_header_bytes`` where the headers outran
    the bound (400 otherwise), in the API's JSON error shape; then the server half-closes
    and drains what the client still sends, for ``LINGER_S`` and ``LINGER_BYTES`` at most,
    before it closes (a lingering close, as nginx does).
    """

    _lingering = False
    _drained = 0

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        bound = self.config.h11_max_incomplete_event_size or 0
        if bound and len(buffered) > bound:
            err = limit_error(
                "max_header_bytes",
                f"the request line and headers run past {bound} bytes; headers may total "
                f"{bound // HEADER_PARSER_FACTOR} bytes",
                431,
            )
        else:
            err = ApiError(400, f"invalid HTTP request: {msg}", param="http")
        body = error_bytes(err, _request_path(buffered))
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=err.status, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        self._lingering = True
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then its end
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)
            return
        self._drained += len(data)  # the refused request's rest: read, so the kernel sends no reset
        if self._drained > LINGER_BYTES:
            self.transport.close()


def _request_path(buffered: bytes) -> str:
    """The path of the request line at the start of ``buffered`` (``/`` if it has none): it
    picks the error's shape, Anthropic's for ``/v1/messages``."""
    line = buffered.split(b"\r\n", 1)[0].split(b" ")
    return line[1].decode("latin-1") if len(line) == 3 else "/"


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
        http=GuardedH11Protocol,
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
