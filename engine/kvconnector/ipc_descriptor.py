"""The CUDA IPC descriptor: what a receiver needs to open one exported CUDA buffer, as bytes.

``IpcDescriptor`` is ``torch.UntypedStorage``'s ``_share_cuda_`` tuple plus the GPU's UUID,
the payload length, a transfer id and an expiry, written as our own struct bytes (never
pickle) with an xxh3-64 checksum; ``IpcDescriptor.decode`` refuses anything else with a
``DescriptorError``. Only bytes here, nothing touches CUDA: the transport that exports and
opens the buffer is ``cuda_ipc.py``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

__all__ = ["DESC_MAGIC", "DESC_VERSION", "MAX_HANDLE_BYTES", "DescriptorError", "IpcDescriptor"]


class DescriptorError(ValueError):
    """A CUDA IPC descriptor that is not ours, of another version, truncated or corrupt."""


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
