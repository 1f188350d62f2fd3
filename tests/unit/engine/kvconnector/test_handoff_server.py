"""Handoff payloads over gRPC (``engine.kvconnector.handoff_server``): a real server on
loopback, its outbox's bounds, and every way a fetch refuses what is not the ticket's."""

from __future__ import annotations

import json
import os
import time

import grpc
import pytest

from engine.kvconnector.handoff_server import (
    CHUNK_BYTES,
    FETCH_BASE_S,
    HandoffFetcher,
    HandoffFetchError,
    HandoffOutbox,
    HandoffServer,
    HandoffTicket,
    fetch_deadline_s,
    is_ticket,
)

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone


@pytest.fixture
def served():
    outbox = HandoffOutbox(max_bytes=64 << 20, ttl_s=60)
    server = HandoffServer(outbox)
    fetcher = HandoffFetcher()
    yield outbox, server, fetcher
    fetcher.close()
    server.stop()


def test_a_payload_of_several_chunks_arrives_whole_and_stays_held(served):
    outbox, server, fetcher = served
    payload = os.urandom(2 * CHUNK_BYTES + 12345)
    ticket = outbox.put("req-1", payload, server.address)
    assert server.address.startswith("127.0.0.1:")
    wire = ticket.to_wire()
    assert is_ticket(wire) and json.loads(json.dumps(wire)) == wire  # plain data
    assert fetcher.fetch(HandoffTicket.from_wire(wire)) == payload
    assert fetcher.fetch(ticket) == payload  # the handoff point: readable again
    assert outbox.counts["fetched"] == 2 and len(outbox) == 1
    assert outbox.drop("req-1") and len(outbox) == 0 and outbox.held_bytes == 0
    with pytest.raises(HandoffFetchError, match="NOT_FOUND"):
        fetcher.fetch(ticket)


def test_an_empty_payload_round_trips(served):
    outbox, server, fetcher = served
    assert fetcher.fetch(outbox.put("empty", b"", server.address)) == b""


def test_a_wrong_token_reads_nothing(served):
    outbox, server, fetcher = served
    ticket = outbox.put("req-2", b"secret kv", server.address)
    forged = HandoffTicket(ticket.address, ticket.handoff_id, bytes(16), ticket.nbytes, ticket.digest)
    with pytest.raises(HandoffFetchError, match="PERMISSION_DENIED"):
        fetcher.fetch(forged)
    # a payload put again under the same id gets a new token: the old ticket is refused
    outbox.put("req-2", b"other kv", server.address)
    with pytest.raises(HandoffFetchError, match="PERMISSION_DENIED"):
        fetcher.fetch(ticket)


def test_bytes_that_are_not_the_tickets_are_refused(served):
    outbox, server, fetcher = served
    ticket = outbox.put("req-3", b"x" * 1000, server.address)
    with pytest.raises(HandoffFetchError, match="digest"):
        fetcher.fetch(HandoffTicket(ticket.address, "req-3", ticket.token, 1000, ticket.digest ^ 1))
    with pytest.raises(HandoffFetchError, match="more than"):
        fetcher.fetch(HandoffTicket(ticket.address, "req-3", ticket.token, 999, ticket.digest))
    with pytest.raises(HandoffFetchError, match="length or digest"):
        fetcher.fetch(HandoffTicket(ticket.address, "req-3", ticket.token, 1001, ticket.digest))


def test_a_holder_that_is_gone_fails_fast():
    outbox = HandoffOutbox()
    server = HandoffServer(outbox)
    ticket = outbox.put("req-4", b"kv", server.address)
    server.stop()
    fetcher = HandoffFetcher()
    t0 = time.monotonic()
    with pytest.raises(HandoffFetchError, match="UNAVAILABLE|DEADLINE"):
        fetcher.fetch(ticket)
    assert time.monotonic() - t0 <= FETCH_BASE_S + 1
    fetcher.close()


def test_out_of_bounds_ids_and_tokens_are_invalid_arguments(served):
    from sluice_proto import handoff_pb2, handoff_pb2_grpc

    _, server, _ = served
    with grpc.insecure_channel(server.address) as channel:
        stub = handoff_pb2_grpc.HandoffServiceStub(channel)
        for hid, token in (("a" * 257, bytes(16)), ("", bytes(16)), ("ok", b"short")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Fetch(handoff_pb2.FetchHandoffRequest(handoff_id=hid, token=token), timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "bad",
    [
        {"transport": "object_store"},
        {"transport": "grpc", "address": "127.0.0.1:1", "id": "r", "token": "zz", "nbytes": 1, "xxh3": 0},
        {"transport": "grpc", "address": "nohost", "id": "r", "token": "00" * 16, "nbytes": 1, "xxh3": 0},
        {"transport": "grpc", "address": "h:1", "id": "r" * 300, "token": "00" * 16, "nbytes": 1, "xxh3": 0},
        {"transport": "grpc", "address": "h:1", "id": "r", "token": "00" * 16, "nbytes": -1, "xxh3": 0},
        {"transport": "grpc", "address": "h:1", "id": "r", "token": "00" * 16, "nbytes": 1},
    ],
)
def test_malformed_tickets_are_refused(bad):
    with pytest.raises(ValueError, match="ticket"):
        HandoffTicket.from_wire(bad)


def test_payloads_expire_after_their_ttl():
    now = [0.0]
    outbox = HandoffOutbox(max_bytes=1000, ttl_s=10, clock=lambda: now[0])
    ticket = outbox.put("a", b"kv", "127.0.0.1:1")
    now[0] = 9.9
    assert outbox.get("a", ticket.token) == b"kv"
    now[0] = 10.0
    with pytest.raises(KeyError):
        outbox.get("a", ticket.token)
    assert outbox.counts["expired"] == 1 and outbox.held_bytes == 0


def test_the_byte_bound_evicts_fetched_payloads_before_waiting_ones():
    outbox = HandoffOutbox(max_bytes=300, ttl_s=60)
    t = {k: outbox.put(k, bytes(100), "h:1") for k in ("old", "mid", "new")}
    outbox.get("mid", t["mid"].token)  # fetched: only a handoff point now
    outbox.put("next", bytes(100), "h:1")
    assert sorted(outbox._held) == ["new", "next", "old"]  # the fetched one went first
    outbox.put("last", bytes(150), "h:1")  # two more must go: the oldest waiting ones
    assert sorted(outbox._held) == ["last", "next"] and outbox.held_bytes == 250
    assert outbox.counts["evicted"] == 3
    with pytest.raises(ValueError, match="over the outbox"):
        outbox.put("huge", bytes(301), "h:1")
    assert outbox.counts["refused"] == 1 and outbox.held_bytes == 250


def test_the_fetch_deadline_follows_the_link():
    assert fetch_deadline_s(0) == FETCH_BASE_S
    # 13.4 MB (a 131,072-token tiny handoff) at 10 Gbit/s, four times over
    assert fetch_deadline_s(13_368_009, 10.0) == pytest.approx(FETCH_BASE_S + 4 * 0.0106944, rel=1e-3)
    assert fetch_deadline_s(10**9, 400.0) == pytest.approx(FETCH_BASE_S + 0.08)
    with pytest.raises(ValueError):
        fetch_deadline_s(1, 0)
