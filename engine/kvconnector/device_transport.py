"""Moving a handoff payload between two processes without Ray: CUDA IPC, torch.distributed p2p.

A sequence handoff is bytes (``EngineCore.export_sequence`` -> ``import_sequence``, the
format is ``payload.py``). These modules move those bytes, or any uint8 tensor, from one
process to another by the cheapest path the two ends share; this one picks it
(``pick_transport``) and re-exports the transports, so every public name is importable here:

- ``TransportKind.CUDA_IPC`` (``CudaIpcTransport``, ``cuda_ipc.py``; the descriptor it
  exchanges is ``ipc_descriptor.py``): both engines on CUDA on one host. The sender exports
  a CUDA buffer holding the payload and offers its descriptor through a
  ``torch.distributed.Store``; the receiver claims it, copies the bytes out and acknowledges.
  The lifetime protocol is in ``cuda_ipc.py``'s docstring.
- ``TransportKind.P2P`` (``P2PTransport``, ``p2p.py``): a torch.distributed process group both
  ends are ranks of (NCCL between GPUs; gloo on CPU). A fixed 24-byte header (magic, version,
  length, sequence number), then the bytes, each a send/recv bounded by a timeout.
- ``TransportKind.BYTES``: anything else. The caller moves the bytes itself (Ray's object
  store, gRPC); these modules have nothing to add.

The errors, ``TransferStats`` and the payload-to-uint8 helpers both transports use are in
``transport_common.py``.

Nothing here verifies the payload's content: ``import_sequence`` checks the header and every
section checksum, so bytes mangled on the way are refused there.
"""

from __future__ import annotations

import enum

import torch

from engine.kvconnector.cuda_ipc import CudaIpcTransport, SharedBuffer, check_openable, open_cuda, share_cuda
from engine.kvconnector.ipc_descriptor import DESC_MAGIC as DESC_MAGIC
from engine.kvconnector.ipc_descriptor import DESC_VERSION as DESC_VERSION
from engine.kvconnector.ipc_descriptor import MAX_HANDLE_BYTES as MAX_HANDLE_BYTES
from engine.kvconnector.ipc_descriptor import DescriptorError, IpcDescriptor
from engine.kvconnector.p2p import P2P_MAGIC as P2P_MAGIC
from engine.kvconnector.p2p import P2P_VERSION as P2P_VERSION
from engine.kvconnector.p2p import P2PTransport
from engine.kvconnector.transport_common import TransferStats, TransportError, TransportTimeout

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
