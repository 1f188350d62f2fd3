"""Bounded replay in the engine: opt-in, marked, and never published.

The tiny checkpoint has 4 layers and a 32-token window: an exact rebuild of a missing window
state replays 4 x 31 = 124 tokens of the hit, a bounded one 31. Every prompt here shares a
3-block (768-token) prefix, and its next tokens differ, so no retained slot matches it: each
hit is served by a replay.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core import EngineCore
from engine.engine_config import EngineConfig
from engine.messages import CoreRequest, SeqOutput
from engine.scheduler.hashing import chain_hashes
from tests.engine_steps import GREEDY, prompt, run_greedy, step_until

PREFIX = prompt(768, 1)
BOUNDED_TOKENS = 32 - 1
EXACT_TOKENS = 4 * (32 - 1)


def _turn(seed: int) -> list[int]:
    return PREFIX + prompt(40, seed)


def _run(
    core: EngineCore, rid: str, tokens: list[int], swa_replay: str | None = None, n: int = 24
) -> tuple[list[int], SeqOutput]:
    return run_greedy(core, rid, tokens, n, swa_replay)


def _cold(model, tokens: list[int], n: int = 24) -> list[int]:
    core = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    return _run(core, "cold", tokens, n=n)[0]


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("tiny")


def _warm(model, **cfg) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(model), cache_event_capacity=1024, **cfg))
    _run(core, "warm", _turn(100), n=2)  # publishes the 3 prefix blocks
    core.drain_events()
    return core


def test_exact_is_the_default_and_equals_a_cold_run(model):
    core = _warm(model)
    tokens = _turn(2)
    out, last = _run(core, "b", tokens)
    assert last.cached_tokens == 768 - EXACT_TOKENS and not last.bounded_replay
    assert core.stats().extra["swa_replays_exact"] == 1
    assert out == _cold(model, tokens)


def test_bounded_replay_is_marked_and_publishes_nothing(model):
    core = _warm(model)
    cached_before = set(core.cached_hashes())
    retained_before = core.stats().extra["retained_swa_slots"]
    tokens = _turn(3)
    out, last = _run(core, "c", tokens, swa_replay="bounded", n=260)  # crosses into a 5th block
    assert last.bounded_replay and last.cached_tokens == 768 - BOUNDED_TOKENS
    extra = core.stats().extra
    assert extra["swa_replays_bounded"] == 1 and extra["swa_replayed_tokens_bounded"] == BOUNDED_TOKENS
    # its two full blocks past the hit were computed from approximate state: not published
    full = (len(tokens) + len(out) - 1) // 256
    assert full == 4
    mine = chain_hashes((tokens + out)[: full * 256], 256, core.extra_keys)
    assert set(core.cached_hashes()) == cached_before and not set(mine[3:]) & cached_before
    assert not any(e.hashes for e in core.drain_events().events if e.kind == "stored")
    assert core.stats().extra["retained_swa_slots"] == retained_before  # its slot was not kept
    # the next turn of that conversation finds only exact state, and equals a cold run
    follow = tokens + out + prompt(30, 4)
    again, last = _run(core, "d", follow)
    assert not last.bounded_replay and last.cached_tokens == 768 - EXACT_TOKENS
    assert again == _cold(model, follow)


def test_the_deployment_default_and_a_request_override(model):
    core = _warm(model, swa_replay="bounded")
    _, last = _run(core, "e", _turn(5))
    assert last.bounded_replay
    _, last = _run(core, "f", _turn(6), swa_replay="exact")
    assert not last.bounded_replay and last.cached_tokens == 768 - EXACT_TOKENS
    with pytest.raises(ValueError, match="swa_replay"):
        core.add(CoreRequest("g", tuple(_turn(7)), GREEDY, swa_replay="sometimes"))
    with pytest.raises(ValueError, match="swa_replay"):
        EngineConfig(model=str(model), swa_replay="fast")


def test_a_hit_shorter_than_the_window_is_exact_even_when_bounded(model):
    core = EngineCore(EngineConfig(model=str(model)))
    _, last = _run(core, "h", prompt(20, 9), swa_replay="bounded")  # no hit at all
    assert not last.bounded_replay and core.stats().extra["swa_replays_bounded"] == 0


def test_a_handed_off_approximate_sequence_stays_unpublished(model):
    a = _warm(model)
    tokens = _turn(8)
    a.add(CoreRequest("i", tuple(tokens), replace(GREEDY, max_tokens=300), swa_replay="bounded"))
    first, _ = step_until(a, "i", n=250)  # 808 + 250 tokens: a 4th full block, approximate
    payload = a.export_sequence("i")
    b = EngineCore(EngineConfig(model=str(model), cache_event_capacity=1024))
    b.import_sequence(payload)
    last = None
    for _ in range(1000):
        last = next((o for o in b.step() if o.finish_reason is not None), None)
        if last is not None:
            break
    assert last is not None and last.finish_reason == "length" and last.bounded_replay
    full = chain_hashes((tokens + first)[:1024], 256, b.extra_keys)
    assert len(full) == 4 and set(b.cached_hashes()) == set(full[:3])  # the exact prefix only
