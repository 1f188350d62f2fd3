"""Waiting for a `sluice serve` subprocess, shared by the tests that start one."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_ready(proc: subprocess.Popen[bytes], url: str, path: str, timeout_s: float = 90.0) -> None:
    """Poll ``url + path`` until it answers 200; fail with the server's output if it exits
    first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"sluice serve did not answer {path} within {timeout_s:.0f} s"
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the server, killing it if it does not exit within 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
