"""Handoff transports between two processes: gRPC and Ray's object store, beside a raw socket.

A payload of each size (``--sizes``) goes from a sending process to a receiving one, the way
a prefill engine's handoff reaches a decode engine:

* ``grpc``: the sender (``services/bench/_handoff_peer.py``, a process of its own) holds the
  payload in a ``HandoffOutbox`` behind a ``HandoffServer``; this process fetches it with
  ``HandoffFetcher`` by its ticket: chunked stream, length and xxh3 check, one contiguous
  buffer at the end, as a decode engine actor does.
* ``raw_tcp`` (the physical peer): the same sender answers a 1-byte request with the
  payload's length and bytes on a plain loopback socket; this process reads them into a
  preallocated buffer. No framing, no check: what the kernel's loopback copy allows.
* ``ray_object_store`` (``--no-ray`` skips it): one Ray actor returns the payload (it lands
  in Ray's object store), another takes its ObjectRef as an argument and returns its length,
  as the serving path passes a handoff's ref from a prefill actor to a decode actor; the time
  is that call's, ``ray.get`` on the length included (one small task round trip).

Each cell is the median of ``--repeats`` transfers after one warm-up. Ratios are against the
raw socket of the same size in the same run. Everything is on loopback, on this host.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

from services.bench import Report, machine_info, module_main, progress

SIZES = ("1MiB", "16MiB", "128MiB")
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _size(text: str) -> int:
    for unit, mult in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes", default=",".join(SIZES), help="payload sizes, a comma list (default 1MiB,16MiB,128MiB)"
    )
    p.add_argument("--repeats", type=int, default=7, help="timed transfers per cell (default 7)")
    p.add_argument("--no-ray", action="store_true", help="skip Ray's object store")


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: connections, allocations
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _RawSocket:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fetch(self) -> int:
        self.sock.sendall(b"?")
        head = self._read(8)
        (n,) = struct.unpack("<Q", head)
        buf = bytearray(n)  # fresh, as a receiver keeps what it received
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:n])
            if k == 0:
                raise ConnectionError("the sender closed the socket")
            got += k
        return n

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the sender closed the socket")
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()


def _ray_pair() -> tuple[Any, Any, Any]:
    import ray

    from services.ray.local_cluster import init_local_ray

    owns = not ray.is_initialized()
    if owns:
        init_local_ray(num_cpus=2)

    @ray.remote(num_cpus=0)
    class Sender:
        def make(self, n: int) -> bytes:
            import numpy as np

            return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()

    @ray.remote(num_cpus=0)
    class Receiver:
        def take(self, payload: bytes) -> int:
            return len(payload)

    return Sender.remote(), Receiver.remote(), owns


def run(args: argparse.Namespace) -> Report:
    from engine.kvconnector.handoff_server import HandoffFetcher, HandoffTicket

    sizes = [_size(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or any(n < 1 for n in sizes):
        raise ValueError("--repeats and every size must be >= 1")
    report = Report(
        "handoff",
        {"sizes_bytes": sizes, "repeats": args.repeats, "ray": not args.no_ray, "machine": machine_info(),
         "method": __doc__},
    )  # fmt: skip
    peer = subprocess.Popen(
        [sys.executable, "-m", "services.bench._handoff_peer"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    fetcher = HandoffFetcher()
    raw: _RawSocket | None = None
    ray_pair = None
    cells: list[dict[str, Any]] = []
    try:
        if not args.no_ray:
            import ray

            progress("handoff: starting Ray on loopback")
            ray_pair = _ray_pair()
        for n in sizes:
            assert peer.stdin is not None and peer.stdout is not None
            peer.stdin.write(f"put {n}\n")
            peer.stdin.flush()
            answer = json.loads(peer.stdout.readline())
            ticket = HandoffTicket.from_wire(answer["ticket"])
            if raw is None:
                raw = _RawSocket(answer["tcp"])
            t = {
                "raw_tcp": _median_s(raw.fetch, args.repeats),
                "grpc": _median_s(lambda t=ticket: fetcher.fetch(t), args.repeats),
            }
            if ray_pair is not None:
                sender, receiver, _ = ray_pair
                ref = sender.make.remote(n)
                ray.wait([ref])
                t["ray_object_store"] = _median_s(
                    lambda r=ref, to=receiver: ray.get(to.take.remote(r)), args.repeats
                )
            row: dict[str, Any] = {"bytes": n}
            for name, s in t.items():
                row[f"{name} ms"] = round(s * 1e3, 3)
                # 3 significant digits: a slow cell of a small size (64 KiB in 150 ms) reads
                # 0.000431 GB/s, not 0.0
                row[f"{name} GB/s"] = float(f"{n / s / 1e9:.3g}")
            for name in t:
                if name != "raw_tcp":
                    row[f"{name} / raw_tcp"] = round(t["raw_tcp"] / t[name], 3)
            cells.append(row)
            report.rows.append(row)
            progress(
                f"handoff: {n} B: raw {t['raw_tcp'] * 1e3:.2f} ms, grpc {t['grpc'] * 1e3:.2f} ms"
                + (f", ray {t['ray_object_store'] * 1e3:.2f} ms" if "ray_object_store" in t else "")
            )
    finally:
        if raw is not None:
            raw.close()
        fetcher.close()
        if peer.stdin is not None:
            peer.stdin.write("quit\n")
            peer.stdin.close()
        peer.wait(timeout=30)
        if ray_pair is not None and ray_pair[2]:
            import ray

            ray.shutdown()
    report.results = {"cells": cells}
    return report


def main() -> None:
    """``python -m services.bench.handoff`` (same as ``sluice bench handoff``)."""
    module_main("handoff", add_arguments, run, None)


if __name__ == "__main__":
    main()
