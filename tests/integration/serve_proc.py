"""Starting and waiting for a `sluice serve` subprocess, shared by the tests that start one.

The server is started with ``--port 0``: it binds a free port before its model loads and
prints ``sluice: listening on URL``, so no test races another process for a port. A thread
drains the server's output the whole time (a full pipe would block the server), and a
failure shows its last lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

_LISTENING = re.compile(r"sluice: listening on (http://\S+)")


class ServeProcess:
    """``python -m services.cli serve --port 0 ARGS`` with ``env``; ``url`` once it listens."""

    def __init__(self, args: list[str], env: dict[str, str], timeout_s: float = 90.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--port", "0", *args],
            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.lines: deque[str] = deque(maxlen=200)
        self._url: str | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._drain, name="serve-output", daemon=True).start()
        if not self._seen.wait(timeout_s) or self._url is None:
            self.stop()
            raise AssertionError(
                f"sluice serve printed no address within {timeout_s:.0f} s:\n{self.output()}"
            )
        self.url: str = self._url

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if self._url is None and (m := _LISTENING.search(line)):
                self._url = m.group(1)
                self._seen.set()
        self._seen.set()  # exited before printing it

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_until_ready(self, path: str, timeout_s: float = 90.0) -> None:
        """Poll ``url + path`` until it answers 200; fail with the server's output if it
        exits first, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, (
                f"sluice serve exited with {self.proc.returncode}:\n{self.output()}"
            )
            try:
                if httpx.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"sluice serve did not answer {path} within {timeout_s:.0f} s"
            time.sleep(0.1)

    def stop(self) -> None:
        """Terminate the server, killing it if it does not exit within 20 s."""
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


@contextmanager
def serve_side_by_side(args: Sequence[list[str]], homes: Sequence[Path]) -> Iterator[list[ServeProcess]]:
    """One ``sluice serve`` per argument list, each with its own ``SLUICE_HOME``, loading side
    by side; yields them once all answer /health, and stops them all on exit."""
    started: list[ServeProcess] = []
    try:
        for a, home in zip(args, homes, strict=True):
            started.append(ServeProcess(a, {"SLUICE_HOME": str(home), "SLUICE_LOG_LEVEL": "WARNING"}))
        for s in started:
            s.wait_until_ready("/health")
        yield started
    finally:
        for s in started:
            s.stop()
