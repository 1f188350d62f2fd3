"""The plain-data forms of what crosses to and from engine actors round-trip exactly, and
hold only types Ray serialises without pickling (no dataclass, tuple or custom object)."""

from __future__ import annotations

import pytest

from engine.scheduler.cache_events import CacheEvent, CacheEventBatch
from engine.scheduler.hashing import ExtraKeys
from services.api.engine_client import EngineOutput, EngineRequest, EngineRequestError, StructuredSpec
from services.ray import wire
from services.ray.actors import error_of, raise_error

PLAIN = (type(None), bool, int, float, str, bytes)


def _plain(x: object) -> bool:
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    return isinstance(x, PLAIN)


@pytest.mark.parametrize(
    "request_",
    [
        EngineRequest("a", (0, 5, 6), 8),
        EngineRequest(
            "b",
            (0, 1),
            3,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            top_logprobs=2,
            stop_token_ids=(4, 9),
            ignore_eos=True,
            structured=StructuredSpec("regex", "[a-z]+"),
            priority=3,
            traffic_class="agent",
            swa_replay="bounded",
        ),  # fmt: skip
    ],
)
def test_requests_round_trip(request_):
    raw = wire.request_to_wire(request_)
    assert _plain(raw)
    assert wire.request_from_wire(raw) == request_


def test_outputs_round_trip():
    for out in (
        EngineOutput("a", (1, 2), None, None, 3, 0, 2),
        EngineOutput("a", (7,), ((-0.5, [(7, -0.5), (8, -1.25)]),), "length", 3, 1, 3),
        EngineOutput("a", (), None, "stop", 900, 737, 4, bounded_replay=True),
    ):
        raw = wire.output_to_wire(out)
        assert _plain(raw)
        assert wire.output_from_wire(raw) == out


def test_cache_events_and_keys_round_trip():
    batch = CacheEventBatch(
        (CacheEvent("stored", (b"\x01" * 32, b"\x02" * 32)), CacheEvent("removed", (b"\x03" * 32,))),
        lost=2,
        snapshot=(b"\x04" * 32,),
    )
    raw = wire.events_to_wire(batch)
    assert _plain(raw) and wire.events_from_wire(raw) == batch
    assert wire.events_from_wire(wire.events_to_wire(CacheEventBatch())) == CacheEventBatch()
    keys = ExtraKeys("model@cpu", ("img1",), "salt")
    assert wire.extra_keys_from_wire(wire.extra_keys_to_wire(keys)) == keys


def test_errors_travel_as_data_and_come_back_as_their_kind():
    from engine.kvconnector.transfer import EngineFull
    from services.api.engine_client import EngineUnavailable

    for exc, kind in (
        (EngineRequestError("bad"), EngineRequestError),
        (EngineFull("no room"), EngineFull),
        (RuntimeError("boom"), EngineUnavailable),
    ):
        item = error_of(exc)
        assert _plain(item)
        with pytest.raises(kind, match=str(exc)):
            raise_error(item)
    raise_error({"request_id": "x"})  # not an error: nothing raised
