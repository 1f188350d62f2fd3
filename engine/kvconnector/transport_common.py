"""What the device transports share: their errors, a transfer's stats, payloads as uint8 tensors.

``device_transport.py`` picks a transport (``pick_transport``); ``cuda_ipc.py`` and ``p2p.py``
are the two that move the bytes themselves. Both raise ``TransportError`` /
``TransportTimeout``, return ``TransferStats`` and take a payload as bytes or as a 1-D uint8
tensor (``_as_uint8``); ``_to_bytes`` turns what they receive back into bytes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["TransferStats", "TransportError", "TransportTimeout"]


class TransportError(RuntimeError):
    """A transfer failed; the message says where (the receiver's reason when it refused)."""


class TransportTimeout(TransportError, TimeoutError):
    """A transfer was not completed within its timeout."""


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
