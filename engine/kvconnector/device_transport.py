"""Moving a handoff payload between two processes without Ray: CUDA IPC, torch.distributed p2p.

A sequence handoff is bytes (``EngineCore.export_sequence`` -> ``import_sequence``, the
format is ``payload.py``). This module moves those bytes, or any uint8 tensor, from one
process to another by the cheapest path the two ends share (``pick_transport``):

- ``TransportKind.CUDA_IPC`` (``CudaIpcTransport``): both engines on CUDA on one host. The
  sender copies the payload into a uint8 CUDA buffer, exports the buffer's CUDA IPC handle
  and writes an ``IpcDescriptor`` (our own struct bytes, never pickle) under a key of a
  ``torch.distributed.Store`` (a ``FileStore`` on one host: nothing listens). The receiver
  claims the offer, opens the handle, copies the bytes into its own memory, lets the mapping
  go and acknowledges; only then does the sender free the buffer.
- ``TransportKind.P2P`` (``P2PTransport``): a torch.distributed process group both ends are
  ranks of (NCCL between GPUs; gloo on CPU). A fixed 24-byte header (magic, version,
  length, sequence number), then the bytes, each a send/recv bounded by a timeout.
- ``TransportKind.BYTES``: anything else. The caller moves the bytes itself (Ray's object
  store, gRPC); this module has nothing to add.

The lifetime protocol of one CUDA IPC transfer, keys under ``<prefix><key>/``::

    sender                                   receiver
    share buffer, set state=offered, desc
                                             wait for desc (timeout)
                                             compare_set(state, offered -> claimed)
                                               lost (state=expired): refuse, open nothing
                                             decode desc, check expiry and that the GPU
                                               is visible; if not: ack = refused:<reason>
                                             open, copy, synchronise, drop the mapping
                                             ack = ok | failed:<reason>
    wait for ack (timeout)
      refused: give back the IPC ref count (nothing was mapped), TransportError
      failed: TransportError
      none: compare_set(state, offered -> expired)
        won (never claimed): give back the IPC ref count, free the buffer, TransportTimeout
        lost (claimed): wait one more timeout for the ack; if none, drop the buffer anyway
          (torch keeps a block that a receiver still maps, "limbo", until it lets go),
          TransportTimeout
    free the buffer, delete the keys

The claim is one atomic ``compare_set``, so a receiver never opens a buffer its sender has
given up on, and a sender never frees a buffer a receiver has claimed before the receiver
lets go of it. The descriptor also carries its expiry (wall clock, same host), for callers
that pass descriptors through their own channel (``share_cuda`` / ``open_cuda``).

Nothing here verifies the payload's content: ``import_sequence`` checks the header and every
section checksum, so bytes mangled on the way are refused there.
"""

from __future__ import annotations

import datetime
import enum
import os
import struct
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

__all__ = [
    "CudaIpcTransport",
    "DescriptorError",
    "IpcDescriptor",
    "P2PTransport",
    "SharedBuffer",
    "TransferStats",
    "TransportError",
    "TransportKind",
    "TransportTimeout",
    "check_openable",
    "open_cuda",
    "pick_transport",
    "share_cuda",
]


class TransportError(RuntimeError):
    """A transfer failed; the message says where (the receiver's reason when it refused)."""


class TransportTimeout(TransportError, TimeoutError):
    """A transfer was not completed within its timeout."""


class DescriptorError(ValueError):
    """A CUDA IPC descriptor that is not ours, of another version, truncated or corrupt."""


# -- picking a transport -----------------------------------------------------------------------
class TransportKind(enum.StrEnum):
    CUDA_IPC = "cuda_ipc"
    P2P = "p2p"
    BYTES = "bytes"


def _kind(device: str | torch.device) -> str:
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return kind


def pick_transport(
    sender_device: str | torch.device,
    receiver_device: str | torch.device,
    *,
    same_host: bool,
    group_backend: str | None = None,
    cuda_ipc: bool = True,
) -> TransportKind:
    """The transport for one handoff, by what both ends can do.

    - a CPU engine and a CUDA engine never hand sequences to each other (their block keys
      name the device kind, so the importer would refuse): ``ValueError``;
    - CPU to CPU: ``BYTES`` (the caller's object store or gRPC);
    - CUDA to CUDA on one host, any GPUs of it: ``CUDA_IPC`` (unless ``cuda_ipc=False``,
      e.g. the processes do not share an IPC namespace);
    - CUDA to CUDA on other hosts (or IPC off) and both ranks of a group whose backend is
      ``group_backend="nccl"``: ``P2P``;
    - otherwise ``BYTES``.
    """
    a, b = _kind(sender_device), _kind(receiver_device)
    if a != b:
        raise ValueError(
            f"a {a} engine cannot hand a sequence to a {b} engine (block keys name the device kind)"
        )
    if a == "cpu":
        return TransportKind.BYTES
    if same_host and cuda_ipc:
        return TransportKind.CUDA_IPC
    if group_backend == "nccl":
        return TransportKind.P2P
    return TransportKind.BYTES


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    seconds: float

    @property
    def ms(self) -> float:
        return self.seconds * 1e3

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _as_uint8(payload: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous uint8 view (no copy for bytes: torch only reads it)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError(f"a payload tensor must be 1-D uint8, got {payload.dtype} {tuple(payload.shape)}")
        return payload.contiguous()
    if len(payload) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffer: never written through
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


# -- the CUDA IPC descriptor -------------------------------------------------------------------
DESC_MAGIC = b"SLIP"
DESC_VERSION = 1
MAX_HANDLE_BYTES = 1024
# magic, version, flags, transfer id, device uuid, device index, storage size, storage
# offset, nbytes, ref counter offset, expiry (unix ms), then three u16 lengths
_DESC_FIXED = struct.Struct("<4sHH16s16sIQQQQQHHH")
_DESC_CHECK = struct.Struct("<Q")
_FLAG_EVENT_SYNC = 1


@dataclass(frozen=True)
class IpcDescriptor:
    """What a receiver needs to open one exported CUDA buffer (``torch.UntypedStorage``'s
    ``_share_cuda_`` tuple, plus the GPU's UUID, the payload length, an id and an expiry).

    Bytes: the fixed part ``_DESC_FIXED`` (little-endian; 102 bytes), then the memory
    handle, the ref-counter handle and the event handle (lengths in the fixed part), then an
    xxh3-64 of everything before it. ``decode`` refuses anything else with a
    ``DescriptorError`` that says what was wrong.
    """

    transfer_id: bytes
    device_uuid: bytes
    device_index: int
    handle: bytes
    storage_size: int
    storage_offset: int
    nbytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    expires_unix_ms: int

    def encode(self) -> bytes:
        if len(self.transfer_id) != 16 or len(self.device_uuid) != 16:
            raise ValueError("transfer_id and device_uuid are 16 bytes each")
        for name in ("handle", "ref_counter_handle", "event_handle"):
            if len(getattr(self, name)) > MAX_HANDLE_BYTES:
                raise ValueError(f"{name} is longer than {MAX_HANDLE_BYTES} bytes")
        if self.nbytes > self.storage_size:
            raise ValueError(f"nbytes {self.nbytes} exceeds the storage's {self.storage_size}")
        body = (
            _DESC_FIXED.pack(
                DESC_MAGIC,
                DESC_VERSION,
                _FLAG_EVENT_SYNC if self.event_sync_required else 0,
                self.transfer_id,
                self.device_uuid,
                self.device_index,
                self.storage_size,
                self.storage_offset,
                self.nbytes,
                self.ref_counter_offset,
                self.expires_unix_ms,
                len(self.handle),
                len(self.ref_counter_handle),
                len(self.event_handle),
            )  # fmt: skip
            + self.handle
            + self.ref_counter_handle
            + self.event_handle
        )
        return body + _DESC_CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> IpcDescriptor:
        data = bytes(data)
        if len(data) < _DESC_FIXED.size + _DESC_CHECK.size:
            raise DescriptorError(
                f"CUDA IPC descriptor truncated: {len(data)} bytes, "
                f"at least {_DESC_FIXED.size + _DESC_CHECK.size} needed"
            )
        (magic, version, flags, tid, dev_uuid, dev_index, size, offset, nbytes, rc_offset, expires,
         n_handle, n_rc, n_event) = _DESC_FIXED.unpack_from(data)  # fmt: skip
        if magic != DESC_MAGIC:
            raise DescriptorError(f"not a CUDA IPC descriptor: magic {magic!r}, expected {DESC_MAGIC!r}")
        if version != DESC_VERSION:
            raise DescriptorError(f"CUDA IPC descriptor version {version}; this reader knows {DESC_VERSION}")
        if flags & ~_FLAG_EVENT_SYNC:
            raise DescriptorError(f"CUDA IPC descriptor has unknown flags {flags:#x}")
        if max(n_handle, n_rc, n_event) > MAX_HANDLE_BYTES:
            raise DescriptorError(f"CUDA IPC descriptor names a handle over {MAX_HANDLE_BYTES} bytes")
        want = _DESC_FIXED.size + n_handle + n_rc + n_event + _DESC_CHECK.size
        if len(data) != want:
            raise DescriptorError(
                f"CUDA IPC descriptor is {len(data)} bytes, its lengths say {want} (truncated or trailing bytes)"
            )
        (check,) = _DESC_CHECK.unpack_from(data, want - _DESC_CHECK.size)
        if check != xxhash.xxh3_64_intdigest(data[: want - _DESC_CHECK.size]):
            raise DescriptorError("CUDA IPC descriptor checksum mismatch (corrupt)")
        if nbytes > size:
            raise DescriptorError(f"CUDA IPC descriptor: nbytes {nbytes} exceeds the storage's {size}")
        p = _DESC_FIXED.size
        handle, rc, event = (
            data[p : p + n_handle],
            data[p + n_handle : p + n_handle + n_rc],
            data[p + n_handle + n_rc : p + n_handle + n_rc + n_event],
        )
        return cls(
            tid, dev_uuid, dev_index, handle, size, offset, nbytes, rc, rc_offset, event,
            bool(flags & _FLAG_EVENT_SYNC), expires,
        )  # fmt: skip


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _device_uuid(index: int) -> bytes:
    u: Any = torch.cuda.get_device_properties(index).uuid
    raw = getattr(u, "bytes", None)
    if raw is not None:
        return bytes(raw)[:16]
    return uuid.UUID(str(u).removeprefix("GPU-")).bytes


def _local_index_of(device_uuid: bytes) -> int:
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == device_uuid:
            return i
    raise TransportError(
        f"the sender's GPU {uuid.UUID(bytes=device_uuid)} is not visible to this process "
        "(CUDA IPC needs the exporting GPU to be visible to the receiver)"
    )


class SharedBuffer:
    """The sender's side of one exported buffer: held until ``release``."""

    def __init__(self, buf: torch.Tensor, descriptor: IpcDescriptor) -> None:
        self._buf: torch.Tensor | None = buf
        self.descriptor = descriptor

    @property
    def released(self) -> bool:
        return self._buf is None

    def release(self, *, opened: bool) -> None:
        """Free the buffer. ``opened=False`` (no receiver ever claimed it) also gives back
        the IPC reference the export took, so the block returns to the allocator instead of
        waiting in torch's limbo for a receiver that will not come."""
        if self._buf is None:
            return
        if not opened:
            d = self.descriptor
            torch.UntypedStorage._release_ipc_counter(
                d.ref_counter_handle, d.ref_counter_offset, device=self._buf.device
            )
        self._buf = None
        torch.cuda.ipc_collect()


def share_cuda(
    payload: bytes | bytearray | memoryview | torch.Tensor,
    device: str | torch.device,
    ttl_s: float = 30.0,
) -> SharedBuffer:
    """Copy ``payload`` into a fresh uint8 buffer on ``device`` (a CUDA tensor already
    there is copied device to device) and export it. The buffer is this call's own: a
    caller's tensor may change afterwards."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"CUDA IPC needs a cuda device, got {device!r}")
    src = _as_uint8(payload)
    if src.numel() == 0:
        raise ValueError("an empty payload has nothing to share")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
    buf.copy_(src)  # on the current stream; the export records an event the receiver waits on
    with torch.cuda.device(dev):
        (index, handle, size, offset, rc, rc_offset, event, sync) = buf.untyped_storage()._share_cuda_()
    desc = IpcDescriptor(
        transfer_id=os.urandom(16),
        device_uuid=_device_uuid(dev.index),
        device_index=int(index),
        handle=bytes(handle),
        storage_size=int(size),
        storage_offset=int(offset),
        nbytes=src.numel(),
        ref_counter_handle=bytes(rc),
        ref_counter_offset=int(rc_offset),
        event_handle=bytes(event) if event is not None else b"",
        event_sync_required=bool(sync),
        expires_unix_ms=_now_ms() + int(ttl_s * 1000),
    )
    return SharedBuffer(buf, desc)


def check_openable(d: IpcDescriptor) -> int:
    """Refuse a descriptor that has expired or names a GPU this process cannot see; else
    the local index of the sender's GPU. Nothing is mapped yet."""
    if _now_ms() > d.expires_unix_ms:
        raise TransportTimeout(f"CUDA IPC descriptor {d.transfer_id.hex()} expired; not opened")
    torch.cuda.init()
    return _local_index_of(d.device_uuid)


def open_cuda(descriptor: IpcDescriptor | bytes, device: str | torch.device) -> torch.Tensor:
    """Open an exported buffer and return a copy of its bytes in this process's memory on
    ``device`` (a CUDA device, or ``cpu``). The copy is complete and the mapping released
    when this returns, so the sender may free its buffer then."""
    d = descriptor if isinstance(descriptor, IpcDescriptor) else IpcDescriptor.decode(descriptor)
    src_index = check_openable(d)
    dst = torch.device(device)
    if dst.type == "cuda" and dst.index is None:
        dst = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(src_index):
        storage = torch.UntypedStorage._new_shared_cuda(
            src_index,
            d.handle,
            d.storage_size,
            d.storage_offset,
            d.ref_counter_handle,
            d.ref_counter_offset,
            d.event_handle,
            d.event_sync_required,
        )  # the current stream waits on the sender's event (when it recorded one)
        view = torch.empty(0, dtype=torch.uint8, device=storage.device)
        view.set_(storage, 0, (d.nbytes,), (1,))
        out = torch.empty(d.nbytes, dtype=torch.uint8, device=dst)
        out.copy_(view)
        torch.cuda.current_stream(src_index).synchronize()
        if dst.type == "cuda":
            torch.cuda.current_stream(dst).synchronize()
        del view, storage  # the receiver's reference goes back to the sender here
    return out


# -- CUDA IPC over a store ---------------------------------------------------------------------
_OFFERED, _CLAIMED, _EXPIRED = b"offered", b"claimed", b"expired"
_REFUSED, _FAILED = "refused: ", "failed: "  # ack prefixes: before / after the handle was opened


def _wait_key(store: dist.Store, key: str, deadline: float) -> bool:
    pause = 0.0005
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.002)


class CudaIpcTransport:
    """One host, CUDA on both ends: see the module's docstring for the protocol.

    ``store`` is any ``torch.distributed.Store`` both processes reach (``FileStore`` on the
    rendezvous file of ``engine/distributed/rendezvous.py``: nothing listens). ``key`` names
    one transfer and must be fresh for each; the sender deletes its keys when done.
    """

    def __init__(
        self,
        store: dist.Store,
        device: str | torch.device,
        *,
        timeout_s: float = 30.0,
        prefix: str = "sluice/ipc/",
    ) -> None:
        # Values are bytes (the descriptor is binary); torch's stubs say str, the store takes both.
        self.store: Any = store
        self.device, self.timeout_s, self.prefix = torch.device(device), timeout_s, prefix

    def _key(self, key: str, part: str) -> str:
        return f"{self.prefix}{key}/{part}"

    # overridable for tests without CUDA
    def _share(self, payload: bytes | bytearray | memoryview | torch.Tensor) -> SharedBuffer:
        return share_cuda(payload, self.device, ttl_s=self.timeout_s)

    def _check(self, descriptor: IpcDescriptor) -> None:
        check_openable(descriptor)

    def _open(self, descriptor: IpcDescriptor, device: torch.device) -> torch.Tensor:
        return open_cuda(descriptor, device)

    def send(self, key: str, payload: bytes | bytearray | memoryview | torch.Tensor) -> TransferStats:
        """Offer ``payload`` under ``key``; returns once the receiver has its copy."""
        t0 = time.perf_counter()
        shared = self._share(payload)
        st, desc, ack = (self._key(key, p) for p in ("state", "desc", "ack"))
        self.store.set(st, _OFFERED)
        self.store.set(desc, shared.descriptor.encode())
        try:
            if not _wait_key(self.store, ack, time.monotonic() + self.timeout_s):
                if self.store.compare_set(st, _OFFERED, _EXPIRED) == _EXPIRED:
                    shared.release(opened=False)
                    raise TransportTimeout(
                        f"CUDA IPC transfer {key!r}: no receiver claimed it within {self.timeout_s:.1f} s"
                    )
                if not _wait_key(self.store, ack, time.monotonic() + self.timeout_s):
                    raise TransportTimeout(
                        f"CUDA IPC transfer {key!r}: claimed but not acknowledged within "
                        f"{2 * self.timeout_s:.1f} s (the buffer is freed when the receiver lets go)"
                    )
            answer = self.store.get(ack)
            if answer.startswith(_REFUSED.encode()):  # never mapped: give the reference back
                shared.release(opened=False)
        finally:
            shared.release(opened=True)  # no-op when released above
            for part in (st, desc, ack):
                self.store.delete_key(part)
        if answer != b"ok":
            raise TransportError(
                f"CUDA IPC transfer {key!r} refused by the receiver: {answer.decode(errors='replace')}"
            )
        return TransferStats(shared.descriptor.nbytes, time.perf_counter() - t0)

    def recv_tensor(self, key: str, device: str | torch.device | None = None) -> torch.Tensor:
        """Take the payload offered under ``key`` as a uint8 tensor on ``device`` (default:
        this transport's device)."""
        st, desc, ack = (self._key(key, p) for p in ("state", "desc", "ack"))
        if not _wait_key(self.store, desc, time.monotonic() + self.timeout_s):
            raise TransportTimeout(
                f"CUDA IPC transfer {key!r}: nothing offered within {self.timeout_s:.1f} s"
            )
        if self.store.compare_set(st, _OFFERED, _CLAIMED) != _CLAIMED:
            raise TransportTimeout(f"CUDA IPC transfer {key!r}: the sender gave up before it was claimed")
        try:  # refused before anything is mapped: the sender gives the IPC reference back itself
            d = IpcDescriptor.decode(self.store.get(desc))
            self._check(d)
        except Exception as exc:
            self.store.set(ack, f"{_REFUSED}{type(exc).__name__}: {exc}".encode())
            raise
        try:
            out = self._open(d, torch.device(device) if device is not None else self.device)
        except Exception as exc:
            self.store.set(ack, f"{_FAILED}{type(exc).__name__}: {exc}".encode())
            raise
        self.store.set(ack, b"ok")
        return out

    def recv(self, key: str) -> bytes:
        """Take the payload offered under ``key`` as bytes (for ``import_sequence``)."""
        return _to_bytes(self.recv_tensor(key))


# -- point to point over a process group -------------------------------------------------------
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
