"""CUDA IPC: a handoff payload from one process to another on one host, both engines on CUDA.

``TransportKind.CUDA_IPC`` of ``device_transport.py`` (``CudaIpcTransport``). The sender
copies the payload into a uint8 CUDA buffer, exports the buffer's CUDA IPC handle and writes
an ``IpcDescriptor`` (our own struct bytes, never pickle: ``ipc_descriptor.py``) under a key
of a ``torch.distributed.Store`` (a ``FileStore`` on one host: nothing listens). The receiver
claims the offer, opens the handle, copies the bytes into its own memory, lets the mapping
go and acknowledges; only then does the sender free the buffer.

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
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from engine.kvconnector.ipc_descriptor import IpcDescriptor
from engine.kvconnector.transport_common import (
    TransferStats,
    TransportError,
    TransportTimeout,
    _as_uint8,
    _to_bytes,
)

__all__ = ["CudaIpcTransport", "SharedBuffer", "check_openable", "open_cuda", "share_cuda"]


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
