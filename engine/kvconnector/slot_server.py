"""Sliding-window slots between engines over gRPC (``proto/sluice_proto/swa.proto``).

``SlotServer`` serves the slots of one engine's host slot pool; ``fetch_slot`` asks another
engine's server for one. The payloads are the KV connector's checksummed format; the
fetching engine verifies them (``verify``) before it keeps them, so a peer of another model,
layout or dtype, or a corrupted transfer, costs a replay, never a wrong answer. The server
binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from engine.scheduler.host_slots import HostSlot, HostSlotPool

MAX_MESSAGE_BYTES = 256 << 20  # a V4.1-Flash slot in bf16 is ~5 MB with its partial block
MAX_TAIL_TOKENS = 4096  # a tail is less than one block


def _stubs():  # the generated modules, imported when a server or client is made
    from sluice_proto import swa_pb2, swa_pb2_grpc

    return swa_pb2, swa_pb2_grpc


_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


class SlotServer:
    """Serves ``pool``'s slots on ``host:port`` (port 0: a free one; ``address`` says which)."""

    def __init__(self, pool: HostSlotPool, host: str = "127.0.0.1", port: int = 0, workers: int = 4) -> None:
        pb, pb_grpc = _stubs()
        self.pool = pool
        self.served = 0  # slots sent
        self.served_bytes = 0

        outer = self

        class _Servicer(pb_grpc.SlotServiceServicer):  # type: ignore[name-defined]
            def FetchSlot(self, request, context):  # noqa: N802 - the generated name
                if len(request.anchor) != 32 or len(request.tail) > MAX_TAIL_TOKENS:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "a slot key is a 32-byte anchor and a tail"
                    )
                entry = outer.pool.get(bytes(request.anchor), tuple(request.tail))
                if entry is None:
                    context.abort(grpc.StatusCode.NOT_FOUND, "slot not held (evicted)")
                    raise AssertionError("unreachable: abort raises")
                outer.served += 1
                outer.served_bytes += entry.nbytes
                return pb.FetchSlotReply(
                    num_tokens=entry.num_tokens, slot=entry.slot_payload, tail_block=entry.tail_payload or b""
                )

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_OPTIONS)
        pb_grpc.add_SlotServiceServicer_to_server(_Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the slot server to {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._server.start()

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait()


def fetch_slot(
    holder: str,
    anchor: bytes,
    tail: Sequence[int],
    num_tokens: int,
    verify: Callable[[HostSlot], None],
    timeout_s: float = 5.0,
) -> HostSlot | None:
    """The slot ``holder`` serves under this key (exact at ``num_tokens``), verified; None if
    it no longer holds it, cannot be reached in ``timeout_s``, or sends something that is not
    that slot or that ``verify`` refuses (ValueError)."""
    pb, pb_grpc = _stubs()
    try:
        with grpc.insecure_channel(holder, options=_OPTIONS) as channel:
            reply = pb_grpc.SlotServiceStub(channel).FetchSlot(
                pb.FetchSlotRequest(anchor=anchor, tail=list(tail)), timeout=timeout_s
            )
    except grpc.RpcError:
        return None
    if reply.num_tokens != num_tokens:
        return None  # not the slot this key names here
    entry = HostSlot(
        anchor, int(reply.num_tokens), tuple(tail), bytes(reply.slot), bytes(reply.tail_block) or None
    )
    try:
        verify(entry)
    except ValueError:
        return None
    return entry
