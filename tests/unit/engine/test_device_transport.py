"""The device transport layer without a GPU: the CUDA IPC descriptor's byte format and its
refusals, ``pick_transport``'s rule, and the CUDA IPC lifetime protocol (offer, claim, ack,
expiry) run on a store with the CUDA calls replaced by host copies. The real CUDA IPC and
NCCL paths are in tests/gpu/; P2P over gloo in tests/integration/engine."""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import xxhash

from engine.kvconnector.device_transport import (
    DESC_MAGIC,
    CudaIpcTransport,
    DescriptorError,
    IpcDescriptor,
    P2PTransport,
    SharedBuffer,
    TransportError,
    TransportKind,
    TransportTimeout,
    open_cuda,
    pick_transport,
    share_cuda,
)

DESC = IpcDescriptor(
    transfer_id=bytes(range(16)),
    device_uuid=bytes(range(100, 116)),
    device_index=3,
    handle=b"h" * 66,
    storage_size=2 << 20,
    storage_offset=4096,
    nbytes=123_457,
    ref_counter_handle=b"/torch_1234_5678_0",
    ref_counter_offset=17,
    event_handle=b"e" * 64,
    event_sync_required=True,
    expires_unix_ms=1_900_000_000_000,
)
FIXED = struct.Struct("<4sHH16s16sIQQQQQHHH")


def _rechecked(body: bytes) -> bytes:
    """``body`` (a descriptor without its checksum) with a valid checksum: so a test reaches
    the check it means and not the checksum."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _edit_fixed(index: int, value: object) -> bytes:
    raw = DESC.encode()[:-8]
    fields = list(FIXED.unpack_from(raw))
    fields[index] = value
    return _rechecked(FIXED.pack(*fields) + raw[FIXED.size :])


# -- the descriptor ----------------------------------------------------------------------------
def test_descriptor_round_trip() -> None:
    raw = DESC.encode()
    assert raw[:4] == DESC_MAGIC and len(raw) == FIXED.size + 66 + len(DESC.ref_counter_handle) + 64 + 8
    assert IpcDescriptor.decode(raw) == DESC
    no_sync = replace(DESC, event_sync_required=False, event_handle=b"")
    assert IpcDescriptor.decode(no_sync.encode()) == no_sync


@pytest.mark.parametrize(
    ("build", "message"),
    [
        pytest.param(lambda: b"", "truncated", id="empty"),
        pytest.param(lambda: DESC.encode()[:50], "truncated", id="short-fixed-part"),
        pytest.param(lambda: DESC.encode()[:-1], "lengths say", id="truncated-handles"),
        pytest.param(lambda: DESC.encode() + b"\0", "lengths say", id="trailing-byte"),
        pytest.param(lambda: b"SLKV" + DESC.encode()[4:], "not a CUDA IPC descriptor", id="other-magic"),
        pytest.param(lambda: _edit_fixed(1, 2), "version 2", id="newer-version"),
        pytest.param(lambda: _edit_fixed(2, 6), "unknown flags", id="unknown-flags"),
        pytest.param(lambda: _edit_fixed(8, (2 << 20) + 1), "exceeds", id="nbytes-over-storage"),
        pytest.param(lambda: _edit_fixed(11, 5000), "over 1024 bytes", id="huge-handle"),
        pytest.param(
            lambda: DESC.encode()[:70] + bytes([DESC.encode()[70] ^ 1]) + DESC.encode()[71:],
            "checksum",
            id="bit-flip",
        ),
    ],
)
def test_malformed_descriptors_are_refused(build, message) -> None:
    with pytest.raises(DescriptorError, match=message):
        IpcDescriptor.decode(build())
    assert issubclass(DescriptorError, ValueError)


def test_a_descriptor_that_cannot_be_encoded_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        replace(DESC, transfer_id=b"short").encode()
    with pytest.raises(ValueError, match="exceeds"):
        replace(DESC, nbytes=DESC.storage_size + 1).encode()
    with pytest.raises(ValueError, match="longer than"):
        replace(DESC, handle=b"x" * 1025).encode()


# -- the rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sender", "receiver", "kw", "want"),
    [
        ("cpu", "cpu", {"same_host": True}, TransportKind.BYTES),
        ("cpu", "cpu", {"same_host": False, "group_backend": "gloo"}, TransportKind.BYTES),
        ("cuda:0", "cuda:0", {"same_host": True}, TransportKind.CUDA_IPC),
        ("cuda:0", "cuda:7", {"same_host": True, "group_backend": "nccl"}, TransportKind.CUDA_IPC),
        (
            "cuda:0",
            "cuda:1",
            {"same_host": True, "cuda_ipc": False, "group_backend": "nccl"},
            TransportKind.P2P,
        ),
        ("cuda", "cuda", {"same_host": False, "group_backend": "nccl"}, TransportKind.P2P),
        ("cuda", "cuda", {"same_host": False, "group_backend": "gloo"}, TransportKind.BYTES),
        ("cuda", "cuda", {"same_host": False}, TransportKind.BYTES),
    ],
)
def test_pick_transport(sender, receiver, kw, want) -> None:
    assert pick_transport(sender, receiver, **kw) is want


def test_pick_transport_refuses_mixed_device_kinds_and_unknown_devices() -> None:
    with pytest.raises(ValueError, match="cannot hand a sequence"):
        pick_transport("cpu", "cuda:0", same_host=True)
    with pytest.raises(ValueError, match="cpu or cuda"):
        pick_transport("meta", "meta", same_host=True)


def test_cuda_ipc_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="cuda device"):
        share_cuda(b"abc", "cpu")
    with pytest.raises(TransportTimeout, match="expired"):
        open_cuda(replace(DESC, expires_unix_ms=1), "cpu")


def test_p2p_refuses_a_tensor_that_is_not_bytes() -> None:
    with pytest.raises(TypeError, match="1-D uint8"):
        P2PTransport().send(torch.zeros(4), dst=1)


# -- the CUDA IPC protocol, CUDA replaced by host copies ---------------------------------------
class FakeShared(SharedBuffer):
    def __init__(self, data: bytes, released: list[tuple[bytes, bool]]) -> None:
        self.data = data
        desc = replace(DESC, transfer_id=os.urandom(16), nbytes=len(data), storage_size=len(data))
        super().__init__(torch.empty(0), desc)
        self._log = released

    def release(self, *, opened: bool) -> None:
        if not self.released:
            self._log.append((self.descriptor.transfer_id, opened))
            self._buf = None


class FakeIpc(CudaIpcTransport):
    """``CudaIpcTransport`` with the CUDA calls replaced: the 'device memory' is a dict."""

    memory: dict[bytes, bytes] = {}

    def __init__(self, store, *, timeout_s=5.0, refuse: bool = False, fail: bool = False) -> None:
        super().__init__(store, "cpu", timeout_s=timeout_s)
        self.released: list[tuple[bytes, bool]] = []
        self.refuse, self.fail = refuse, fail

    def _share(self, payload):
        shared = FakeShared(bytes(payload), self.released)
        self.memory[shared.descriptor.transfer_id] = shared.data
        return shared

    def _check(self, descriptor):
        if self.refuse:
            raise TransportError("GPU not visible")

    def _open(self, descriptor, device):
        if self.fail:
            raise RuntimeError("copy failed")
        return torch.frombuffer(bytearray(self.memory[descriptor.transfer_id]), dtype=torch.uint8)


def _sender(tx: CudaIpcTransport, key: str, payload: bytes, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            out["stats"] = tx.send(key, payload)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_ipc_protocol_moves_the_bytes_and_cleans_up() -> None:
    store = dist.HashStore()
    tx, rx = FakeIpc(store), FakeIpc(store)
    payload = os.urandom(100_000)
    out: dict = {}
    t = _sender(tx, "seq-1", payload, out)
    assert rx.recv("seq-1") == payload
    t.join(10)
    assert "error" not in out and out["stats"].nbytes == len(payload)
    assert [opened for _, opened in tx.released] == [True]  # freed only after the ack
    assert not any(store.check([f"sluice/ipc/seq-1/{p}"]) for p in ("state", "desc", "ack"))


def test_ipc_sender_gives_up_when_nobody_claims_and_a_late_receiver_opens_nothing() -> None:
    store = dist.HashStore()
    tx = FakeIpc(store, timeout_s=0.2)
    with pytest.raises(TransportTimeout, match="no receiver claimed"):
        tx.send("seq-2", b"payload")
    assert [opened for _, opened in tx.released] == [False]  # the IPC reference is given back
    # A receiver that comes now finds nothing offered (the keys are gone) and times out.
    with pytest.raises(TransportTimeout, match="nothing offered"):
        FakeIpc(store, timeout_s=0.1).recv("seq-2")


def test_ipc_a_receiver_loses_the_claim_to_an_expired_offer() -> None:
    store = dist.HashStore()
    store.set("sluice/ipc/k/state", b"expired")
    store.set("sluice/ipc/k/desc", DESC.encode())
    rx = FakeIpc(store)
    with pytest.raises(TransportTimeout, match="gave up"):
        rx.recv("k")
    assert not store.check(["sluice/ipc/k/ack"])


@pytest.mark.parametrize(
    ("kw", "error", "opened"),
    [({"refuse": True}, "refused: TransportError: GPU not visible", False),
     ({"fail": True}, "failed: RuntimeError: copy failed", True)],
    ids=["refused-before-mapping", "failed-after-mapping"],
)  # fmt: skip
def test_ipc_a_receiver_error_reaches_the_sender(kw, error, opened) -> None:
    store = dist.HashStore()
    tx, rx = FakeIpc(store), FakeIpc(store, **kw)
    out: dict = {}
    t = _sender(tx, "seq-3", b"x" * 1000, out)
    with pytest.raises((TransportError, RuntimeError)):
        rx.recv("seq-3")
    t.join(10)
    assert isinstance(out["error"], TransportError) and error in str(out["error"])
    assert [o for _, o in tx.released] == [opened]


def test_ipc_a_corrupt_descriptor_is_refused_by_the_receiver() -> None:
    store = dist.HashStore()
    store.set("sluice/ipc/bad/state", b"offered")
    store.set("sluice/ipc/bad/desc", b"SLIP" + bytes(200))
    with pytest.raises(DescriptorError):
        FakeIpc(store).recv("bad")
    assert store.get("sluice/ipc/bad/ack").startswith(b"refused: DescriptorError")
