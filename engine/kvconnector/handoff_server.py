"""Handoff payloads between engines over gRPC (``proto/sluice_proto/handoff.proto``).

The other way a handoff travels, beside Ray's object store: the prefill engine keeps the
payload of each sequence it exported in its ``HandoffOutbox`` and answers with a
``HandoffTicket`` (plain data: where, which, how long, a digest and a secret); the decode
engine that imports the sequence fetches the payload from the prefill engine's
``HandoffServer`` with ``HandoffFetcher``, in chunks, and checks its length and digest
before the importer checks the payload itself (docs/kv-connector.md).

The outbox keeps a payload after it was fetched: it is the request's handoff point, from
which a second decode engine resumes when the first one dies. The caller drops it when the
request ends; besides, the outbox is bounded in bytes (the oldest payloads go first, those
already fetched before those still waiting) and in time (``ttl_s``). A payload that is gone
costs a new prefill from the KV store, never a wrong answer.

The server binds 127.0.0.1 unless told otherwise. A ticket's token is 16 random bytes
compared in constant time: a process that can reach the port but never saw the ticket
reads nothing.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash

CHUNK_BYTES = 1 << 20  # one streamed message (gRPC's default message limit is 4 MiB)
MAX_ID_BYTES = 256  # a handoff id is a request id
TOKEN_BYTES = 16
# A fetch may take LINK_SAFETY times the payload's time at the link's rate (the link shared
# by that many handoffs at once) plus FETCH_BASE_S, the bound within which a peer that does
# not answer is declared lost (the same 5 s as an EP group's collective timeout).
FETCH_BASE_S = 5.0
LINK_SAFETY = 4.0
DEFAULT_LINK_GBPS = 10.0  # no link rate in the cluster spec: the slowest datacentre NIC we expect
DEFAULT_MAX_HELD_BYTES = 4 << 30
DEFAULT_TTL_S = 600.0


class HandoffFetchError(Exception):
    """The payload could not be fetched whole: not held any more, its holder unreachable or
    too slow, a wrong ticket, or bytes that are not the ticket's. The request is prefilled
    again (its prefix blocks come from the KV store)."""


def _stubs():  # the generated modules, imported when a server or client is made
    from sluice_proto import handoff_pb2, handoff_pb2_grpc

    return handoff_pb2, handoff_pb2_grpc


def fetch_deadline_s(nbytes: int, link_gbps: float = DEFAULT_LINK_GBPS) -> float:
    """How long fetching ``nbytes`` may take over a link of ``link_gbps`` (see the module's
    constants)."""
    if link_gbps <= 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
    return FETCH_BASE_S + LINK_SAFETY * nbytes * 8 / (link_gbps * 1e9)


@dataclass(frozen=True)
class HandoffTicket:
    """What the importer needs to fetch one payload; crosses processes as plain data."""

    address: str  # host:port of the holder's HandoffServer
    handoff_id: str
    token: bytes
    nbytes: int
    digest: int  # xxh3-64 of the payload

    def to_wire(self) -> dict[str, Any]:
        return {
            "transport": "grpc",
            "address": self.address,
            "id": self.handoff_id,
            "token": self.token.hex(),
            "nbytes": self.nbytes,
            "xxh3": self.digest,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> HandoffTicket:
        """The ticket ``to_wire`` wrote; ValueError naming what is wrong otherwise."""
        if not is_ticket(d):
            raise ValueError("not a gRPC handoff ticket")
        try:
            address, hid, token = str(d["address"]), str(d["id"]), bytes.fromhex(str(d["token"]))
            nbytes, digest = int(d["nbytes"]), int(d["xxh3"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed handoff ticket: {exc!r}") from None
        if ":" not in address or not 0 < len(hid.encode()) <= MAX_ID_BYTES or len(token) != TOKEN_BYTES:
            raise ValueError("a malformed handoff ticket: address, id or token out of bounds")
        if nbytes < 0 or not 0 <= digest < 2**64:
            raise ValueError("a malformed handoff ticket: length or digest out of range")
        return cls(address, hid, token, nbytes, digest)


def is_ticket(obj: object) -> bool:
    return isinstance(obj, Mapping) and obj.get("transport") == "grpc"


@dataclass
class _Held:
    payload: bytes
    token: bytes
    expires: float
    fetched: bool = False


class HandoffOutbox:
    """Payloads held for their importers, by handoff id; thread-safe. Bounded by
    ``max_bytes`` (eviction as in the module doc) and ``ttl_s`` per payload."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_HELD_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 1 or ttl_s <= 0:
            raise ValueError(f"max_bytes must be >= 1 and ttl_s > 0, got {max_bytes}, {ttl_s}")
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.counts = dict.fromkeys(("put", "fetched", "dropped", "expired", "evicted", "refused"), 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def put(self, handoff_id: str, payload: bytes, address: str) -> HandoffTicket:
        """Hold ``payload`` (replacing one held under the same id); its ticket. ValueError if
        it alone is over the bound (the caller hands it off another way)."""
        if not 0 < len(handoff_id.encode()) <= MAX_ID_BYTES:
            raise ValueError(f"a handoff id has 1 to {MAX_ID_BYTES} bytes")
        if len(payload) > self.max_bytes:
            with self._lock:
                self.counts["refused"] += 1
            raise ValueError(f"a {len(payload)}-byte payload is over the outbox's {self.max_bytes} bytes")
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._expire()
            self._pop(handoff_id)
            while self.held_bytes + len(payload) > self.max_bytes:
                victim = next((k for k, h in self._held.items() if h.fetched), next(iter(self._held)))
                self._pop(victim)
                self.counts["evicted"] += 1
            self._held[handoff_id] = _Held(payload, token, self._clock() + self.ttl_s)
            self.held_bytes += len(payload)
            self.counts["put"] += 1
        return HandoffTicket(address, handoff_id, token, len(payload), xxhash.xxh3_64_intdigest(payload))

    def get(self, handoff_id: str, token: bytes) -> bytes:
        """The payload; KeyError if not held, PermissionError for a wrong token."""
        with self._lock:
            self._expire()
            held = self._held.get(handoff_id)
            if held is None:
                raise KeyError(handoff_id)
            if not hmac.compare_digest(token, held.token):
                raise PermissionError("wrong handoff token")
            held.fetched = True
            self.counts["fetched"] += 1
            return held.payload

    def drop(self, handoff_id: str) -> bool:
        """Let the payload go (its request ended); whether it was held."""
        with self._lock:
            gone = self._pop(handoff_id)
            if gone:
                self.counts["dropped"] += 1
            return gone

    def _pop(self, handoff_id: str) -> bool:
        held = self._held.pop(handoff_id, None)
        if held is not None:
            self.held_bytes -= len(held.payload)
        return held is not None

    def _expire(self) -> None:
        now = self._clock()
        for hid in [k for k, h in self._held.items() if h.expires <= now]:
            self._pop(hid)
            self.counts["expired"] += 1


class HandoffServer:
    """Serves ``outbox`` on ``host:port`` (port 0: a free one; ``address`` says which)."""

    def __init__(
        self, outbox: HandoffOutbox, host: str = "127.0.0.1", port: int = 0, workers: int = 4
    ) -> None:
        pb, pb_grpc = _stubs()
        self.outbox = outbox

        class _Servicer(pb_grpc.HandoffServiceServicer):  # type: ignore[name-defined]
            def Fetch(self, request, context) -> Iterator[Any]:  # noqa: N802 - the generated name
                hid, token = request.handoff_id, bytes(request.token)
                if not 0 < len(hid.encode()) <= MAX_ID_BYTES or len(token) != TOKEN_BYTES:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a handoff id and a 16-byte token")
                try:
                    payload = outbox.get(hid, token)
                except KeyError:
                    context.abort(
                        grpc.StatusCode.NOT_FOUND, f"handoff {hid!r} is not held (ended or evicted)"
                    )
                    raise AssertionError("unreachable: abort raises") from None
                except PermissionError:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong handoff token")
                    raise AssertionError("unreachable: abort raises") from None
                view = memoryview(payload)
                for start in range(0, len(payload), CHUNK_BYTES):
                    yield pb.HandoffChunk(data=bytes(view[start : start + CHUNK_BYTES]))

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        pb_grpc.add_HandoffServiceServicer_to_server(_Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the handoff server to {host}:{port}")
        self.host = host
        self.address = f"{host}:{self.port}"
        self._server.start()

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait()


class HandoffFetcher:
    """Fetches payloads by ticket, one gRPC channel per holder address, kept open."""

    def __init__(self, link_gbps: float = DEFAULT_LINK_GBPS) -> None:
        fetch_deadline_s(0, link_gbps)  # checks the rate
        self.link_gbps = link_gbps
        self._stubs: dict[str, tuple[grpc.Channel, Any]] = {}
        self._lock = threading.Lock()

    def fetch(self, ticket: HandoffTicket) -> bytes:
        """The payload, whole and checked; HandoffFetchError otherwise. Blocking: at most
        ``fetch_deadline_s(ticket.nbytes, link_gbps)`` seconds."""
        pb, pb_grpc = _stubs()
        with self._lock:
            held = self._stubs.get(ticket.address)
            if held is None:
                channel = grpc.insecure_channel(ticket.address)
                held = self._stubs[ticket.address] = (channel, pb_grpc.HandoffServiceStub(channel))
            stub = held[1]
        chunks: list[bytes] = []
        got = 0
        try:
            stream = stub.Fetch(
                pb.FetchHandoffRequest(handoff_id=ticket.handoff_id, token=ticket.token),
                timeout=fetch_deadline_s(ticket.nbytes, self.link_gbps),
            )
            for chunk in stream:
                data = chunk.data
                if got + len(data) > ticket.nbytes:
                    stream.cancel()
                    raise HandoffFetchError(
                        f"handoff {ticket.handoff_id!r}: {ticket.address} sent more than the ticket's {ticket.nbytes} bytes"
                    )
                chunks.append(data)
                got += len(data)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            raise HandoffFetchError(
                f"handoff {ticket.handoff_id!r} from {ticket.address}: {name}: "
                f"{exc.details() if hasattr(exc, 'details') else exc}"
            ) from None
        out = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # (one chunk: no copy)
        if got != ticket.nbytes or xxhash.xxh3_64_intdigest(out) != ticket.digest:
            raise HandoffFetchError(
                f"handoff {ticket.handoff_id!r}: {got} bytes from {ticket.address} are not the ticket's "
                f"{ticket.nbytes} (length or digest differ)"
            )
        return out

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
