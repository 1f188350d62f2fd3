"""How handoff payloads travel from prefill to decode engine actors.

Two transports, chosen per deployment (``HandoffConfig.transport``; the cluster spec's
``handoff.transport``, where ``auto`` picks by where the pools run):

* ``object_store``: the prefill actor returns the payload bytes; the API process passes
  their ObjectRef on to the decode actor without fetching them, and Ray moves the bytes
  between the two actors' nodes. The handoff point (the payload a second decode engine
  resumes from when the first dies) lives as long as the API process holds the ref.
* ``grpc``: the prefill actor keeps the payload in its outbox and returns a ticket; the
  decode actor fetches the payload from the prefill actor's gRPC server
  (``engine.kvconnector.handoff_server``), with a deadline from the link's rate. The handoff
  point lives in the prefill actor until the request ends (the API process drops it), its
  TTL passes, or the outbox's byte bound evicts it. The bytes go straight from one engine to
  the other over a connection of their own, whatever the Ray cluster spans.

A payload that is gone or cannot be fetched costs a new prefill (its prefix blocks from the
KV store), never a wrong answer: the importer checks every payload.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

from engine.kvconnector.handoff_server import (
    DEFAULT_LINK_GBPS,
    DEFAULT_MAX_HELD_BYTES,
    DEFAULT_TTL_S,
    HandoffFetcher,
    HandoffOutbox,
    HandoffServer,
    HandoffTicket,
)

TRANSPORTS = ("object_store", "grpc")


@dataclass(frozen=True)
class HandoffConfig:
    """``transport``: see the module doc. ``host``: the address the prefill actors' gRPC
    servers bind (loopback by default; ``0.0.0.0`` binds all and advertises the node's IP).
    ``max_held_bytes`` / ``ttl_s``: each prefill actor's outbox bounds. ``link_gbps``: the
    link rate between the pools, which sets the fetch deadline."""

    transport: Literal["object_store", "grpc"] = "object_store"
    host: str = "127.0.0.1"
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    ttl_s: float = DEFAULT_TTL_S
    link_gbps: float = DEFAULT_LINK_GBPS

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"handoff transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.max_held_bytes < 1 or self.ttl_s <= 0 or self.link_gbps <= 0:
            raise ValueError("handoff max_held_bytes, ttl_s and link_gbps must be positive")


class ActorHandoffs:
    """An engine actor's side of the handoffs: the outbox and server of a prefill actor
    under ``grpc``, the fetcher of a decode actor (made at its first ticket)."""

    def __init__(self, config: HandoffConfig, role: str, log: logging.LoggerAdapter[Any]) -> None:
        self.config, self.role, self.log = config, role, log
        self.outbox: HandoffOutbox | None = None
        self.server: HandoffServer | None = None
        self._fetcher: HandoffFetcher | None = None
        self.fetched = 0
        self.fetched_bytes = 0
        self.fetch_s = 0.0

    def start(self) -> None:
        """Start the prefill actor's server (once; nothing for other roles or transports)."""
        if self.role != "prefill" or self.config.transport != "grpc" or self.server is not None:
            return
        self.outbox = HandoffOutbox(self.config.max_held_bytes, self.config.ttl_s)
        self.server = HandoffServer(self.outbox, self.config.host)
        self.log.info("handoff server on %s", self.server.address)

    def offer(self, request_id: str, payload: bytes) -> bytes | dict[str, Any]:
        """What ``prefill`` returns for ``payload``: the bytes (object store), or a ticket.
        A payload over the outbox's bound travels as bytes."""
        if self.outbox is None or self.server is None:
            return payload
        try:
            return self.outbox.put(request_id, payload, self._advertised()).to_wire()
        except ValueError as exc:
            self.log.warning("request %s: %s; handing it off through the object store", request_id, exc)
            return payload

    def _advertised(self) -> str:
        assert self.server is not None
        host = self.server.host
        if host in ("0.0.0.0", "::", ""):
            host = _node_ip()
        return f"{host}:{self.server.port}"

    def fetch(self, ticket_wire: Any) -> bytes:
        """The payload of a ticket (blocking; run it off the event loop). ValueError for a
        malformed ticket, ``HandoffFetchError`` for a payload that cannot be had."""
        ticket = HandoffTicket.from_wire(ticket_wire)
        if self._fetcher is None:
            self._fetcher = HandoffFetcher(self.config.link_gbps)
        t0 = time.perf_counter()
        payload = self._fetcher.fetch(ticket)
        self.fetched += 1
        self.fetched_bytes += len(payload)
        self.fetch_s += time.perf_counter() - t0
        return payload

    def drop(self, request_id: str) -> bool:
        return self.outbox.drop(request_id) if self.outbox is not None else False

    def stats(self) -> dict[str, float]:
        """Counters for ``EngineStats.extra``: what the outbox holds, what was fetched."""
        out = {"handoffs_held": 0.0, "handoff_held_bytes": 0.0}
        if self.outbox is not None:
            out["handoffs_held"] = float(len(self.outbox))
            out["handoff_held_bytes"] = float(self.outbox.held_bytes)
            out.update({f"handoff_outbox_{k}": float(v) for k, v in self.outbox.counts.items()})
        if self._fetcher is not None:
            out.update(
                handoff_fetched=float(self.fetched),
                handoff_fetched_bytes=float(self.fetched_bytes),
                handoff_fetch_seconds=self.fetch_s,
            )
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - outside Ray: this host's name's address
        return socket.gethostbyname(socket.gethostname())
