"""Two emulated hosts on this machine: network namespaces joined by one shaped link.

``TwoSites`` creates namespaces ``<prefix>a`` and ``<prefix>b`` (each with its own loopback),
joins them by a veth pair (``10.211.0.1`` in a, ``10.211.0.2`` in b), and shapes both ends
with a token bucket (``tc tbf``) at ``rate_mbit``: each namespace is a host with one network
card, and the pair is the link between two sites. Nothing outside the two namespaces is
reachable from them, and nothing in them from outside: the network rule for tests holds.

Processes started with ``run`` live in a namespace; ``close`` kills every process still
in either namespace (``ip netns pids``), whatever started it, then deletes them.

Needs ``ip`` and ``tc`` and the right to create namespaces (root, or CAP_NET_ADMIN):
``available()`` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ADDRESSES = {"a": "10.211.0.1", "b": "10.211.0.2"}


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"slprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


class TwoSites:
    def __init__(self, rate_mbit: float, prefix: str | None = None) -> None:
        self.rate_mbit = rate_mbit
        p = prefix or f"sl{os.getpid() % 100000}"
        self.ns = {"a": f"{p}a", "b": f"{p}b"}
        self.dev = {"a": f"{p}va", "b": f"{p}vb"}  # <= 15 characters: interface names
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> TwoSites:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for site in ("a", "b"):
            ns, dev = self.ns[site], self.dev[site]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDRESSES[site]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
            # burst: at least one 10 ms tick of the rate (tbf needs it), and a full frame
            burst = max(int(self.rate_mbit * 1e6 / 8 / 100), 16_384)
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                  "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "500ms"])  # fmt: skip

    def run(
        self, site: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``argv`` in site ``site``'s namespace, its output to ``log``; stopped by ``close``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[site], *argv],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=host_env(env), start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def call(self, site: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
        """Run ``argv`` in the namespace to its end; its stdout (raises with its output on failure)."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[site], *argv],
            capture_output=True, text=True, timeout=timeout_s, env=host_env(env),
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(
                f"{argv[:3]} in site {site} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )
        return r.stdout

    def sent_bytes(self, site: str) -> int:
        """Bytes the site's end of the link has sent (its shaper's counter)."""
        out = _run(["tc", "-n", self.ns[site], "-s", "qdisc", "show", "dev", self.dev[site]])
        words = out.split()
        return int(words[words.index("Sent") + 1])

    def listeners(self, site: str) -> list[tuple[str, str]]:
        """(local address, process) of every listening TCP socket in the site's namespace."""
        out = _run(["ip", "netns", "exec", self.ns[site], "ss", "-ltnpH"])
        return [(p[3], " ".join(p[5:])) for p in (line.split() for line in out.splitlines()) if len(p) >= 4]

    def close(self) -> None:
        for proc in self.procs:  # their own process groups first: a clean stop where it works
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.1))
        for ns in self.ns.values():  # then whatever is left in the namespaces
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        # a pair that never reached its namespaces (a failed start) is still here
        subprocess.run(["ip", "link", "del", self.dev["a"]], capture_output=True, check=False)


def host_env(extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of a process on an emulated host: this one's, less what the test
    session's own loopback Ray and EP groups exported (``RAY_*``, ``GLOO_*``: a one-host
    cluster's settings, wrong on a host of a two-host one), plus ``extra``."""
    own = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GLOO_"))}
    return {**own, **(extra or {})}


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout
