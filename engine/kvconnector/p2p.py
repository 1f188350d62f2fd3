"""Point to point over a torch.distributed process group: NCCL between GPUs, gloo on CPU.

``TransportKind.P2P`` of ``device_transport.py`` (``P2PTransport``): a process group both
ends are ranks of. A fixed 24-byte header (magic, version, flags, length, sequence number),
then the bytes, each a send/recv bounded by a timeout.
"""

from __future__ import annotations

import datetime
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.kvconnector.transport_common import (
    TransferStats,
    TransportError,
    TransportTimeout,
    _as_uint8,
    _to_bytes,
)

__all__ = ["P2P_MAGIC", "P2P_VERSION", "P2PTransport"]


P2P_MAGIC = b"SLXP"
P2P_VERSION = 1
_P2P_HEADER = struct.Struct("<4sHHQQ")  # magic, version, flags (0), nbytes, sequence number


class P2PTransport:
    """Send / receive payloads between ranks of a torch.distributed group (NCCL between
    GPUs, gloo on CPU): a 24-byte header, then the bytes.

    Each wait is bounded by ``timeout_s`` (``TransportTimeout``). After a timeout or a
    refused header the pair's stream of messages is out of step, and an NCCL operation
    cannot be cancelled: tear the group down (``destroy_process_group``) and build a new
    one. Under NCCL, make some collective the group's first operation before the first
    send (as ``tests/gpu/test_handoff_nccl.py`` does).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float = 60.0,
        max_bytes: int = 1 << 34,
    ) -> None:
        self.group, self.device, self.timeout_s, self.max_bytes = (
            group,
            torch.device(device),
            timeout_s,
            max_bytes,
        )
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def _wait(self, work: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        if self.device.type == "cpu":  # gloo: a blocking wait with a timeout
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise TransportTimeout(f"{what} not done within {self.timeout_s:.1f} s: {exc}") from exc
            return
        pause = 0.0001
        while not work.is_completed():  # NCCL: poll; wait() would only order the stream
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{what} not done within {self.timeout_s:.1f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        work.wait()

    def send(self, payload: bytes | bytearray | memoryview | torch.Tensor, dst: int) -> TransferStats:
        t0 = time.perf_counter()
        data = _as_uint8(payload)
        n = data.numel()
        if n > self.max_bytes:
            raise ValueError(f"payload of {n} bytes is over this transport's limit of {self.max_bytes}")
        seq = self._sent.get(dst, 0)
        self._sent[dst] = seq + 1
        header = _as_uint8(bytearray(_P2P_HEADER.pack(P2P_MAGIC, P2P_VERSION, 0, n, seq))).to(self.device)
        self._wait(dist.isend(header, dst, group=self.group), f"header to rank {dst}")
        if n:
            self._wait(dist.isend(data.to(self.device), dst, group=self.group), f"{n} bytes to rank {dst}")
        return TransferStats(n, time.perf_counter() - t0)

    def recv_tensor(self, src: int) -> torch.Tensor:
        """The next payload from ``src``, as a uint8 tensor on this transport's device."""
        header = torch.empty(_P2P_HEADER.size, dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(header, src, group=self.group), f"header from rank {src}")
        magic, version, flags, n, seq = _P2P_HEADER.unpack(_to_bytes(header))
        want = self._received.get(src, 0)
        if magic != P2P_MAGIC or version != P2P_VERSION or flags:
            raise TransportError(
                f"rank {src} sent a header that is not ours: magic {magic!r} version {version} flags {flags}, "
                f"expected {P2P_MAGIC!r} version {P2P_VERSION} flags 0"
            )
        if seq != want:
            raise TransportError(f"rank {src} sent message {seq}, expected {want} (out of step)")
        if n > self.max_bytes:
            raise TransportError(
                f"rank {src} announces {n} bytes, over this transport's limit of {self.max_bytes}"
            )
        self._received[src] = want + 1
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._wait(dist.irecv(out, src, group=self.group), f"{n} bytes from rank {src}")
        return out

    def recv(self, src: int) -> bytes:
        return _to_bytes(self.recv_tensor(src))
