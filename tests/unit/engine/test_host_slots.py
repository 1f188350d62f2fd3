"""The host slot pool: a conversation's next turn continues from its last turn's window state
after the device's retained slot is gone, with no replay, and equals a cold run.

The tiny checkpoint (4 layers, 32-token window) would otherwise replay 4 x 31 = 124 tokens of
the hit, and only a hit of full blocks: a host slot also serves the partial block.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core import EngineCore
from engine.engine_config import EngineConfig
from engine.messages import CoreRequest, SeqOutput
from engine.scheduler.hashing import ROOT_HASH, chain_hashes
from engine.scheduler.host_slots import HostSlot, HostSlotPool
from tests.engine_steps import GREEDY, prompt, run_greedy


def _run(core: EngineCore, rid: str, tokens: list[int], n: int = 20) -> tuple[list[int], SeqOutput]:
    return run_greedy(core, rid, tokens, n)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("tiny")


def _conversation(core: EngineCore, n: int = 20) -> tuple[list[int], list[int], SeqOutput]:
    """Turn 1, two other sequences that take both device slots (so turn 1's retained slot is
    reused), then turn 2: (turn 2's prompt, its tokens, its last message)."""
    first = prompt(600, 1)
    out, _ = _run(core, "turn-1", first)
    for i in range(2):
        _run(core, f"other-{i}", prompt(300, 10 + i), n=2)
    assert core.stats().extra["retained_swa_slots"] == 2  # the others', not turn 1's
    follow = first + out + prompt(30, 2)
    tokens, last = _run(core, "turn-2", follow, n)
    return follow, tokens, last


def test_the_next_turn_continues_from_the_host_slot_and_equals_a_cold_run(model):
    cfg = dict(model=str(model), num_swa_slots=2, max_num_seqs=2)
    core = EngineCore(EngineConfig(**cfg, host_swa_bytes=64 << 20))
    follow, tokens, last = _conversation(core)
    assert last.cached_tokens == 600 + 19  # its whole computed prefix, partial block included
    extra = core.stats().extra
    assert extra["swa_slot_hits_host"] == 1 and extra["swa_replays_exact"] == 0
    assert extra["host_swa_slots"] >= 3 and 0 < extra["host_swa_bytes"] <= 64 << 20
    cold = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    assert tokens == _run(cold, "cold", follow)[0]
    plain = EngineCore(EngineConfig(**cfg))  # no host pool: the hit's full blocks are replayed
    _, control, last = _conversation(plain)
    assert last.cached_tokens == 512 - 124 and plain.stats().extra["swa_replays_exact"] == 1
    assert control == tokens


def test_the_pool_keeps_the_longest_match_within_its_byte_budget():
    pool = HostSlotPool(budget_bytes=100)
    a = HostSlot(ROOT_HASH, 3, (5, 6, 7), b"s" * 40, b"t" * 10)
    b = HostSlot(ROOT_HASH, 5, (5, 6, 7, 8, 9), b"s" * 40, None)
    assert pool.put(a) and pool.put(b) and pool.nbytes == 90
    assert pool.match([ROOT_HASH], [5, 6, 7, 8, 9, 1], 16, 6) is b
    assert pool.match([ROOT_HASH], [5, 6, 7, 8, 9, 1], 16, 4) is a  # b would leave nothing to compute
    assert pool.match([ROOT_HASH], [5, 6, 1], 16, 3) is None
    c = HostSlot(b"x" * 32, 20, (1,), b"s" * 30, None)
    assert pool.put(c) and len(pool) == 2 and pool.evicted == 1  # b: a was matched after it
    assert pool.match([ROOT_HASH], [5, 6, 7, 8, 9, 1], 16, 6) is a
    assert not pool.put(HostSlot(ROOT_HASH, 1, (5,), b"s" * 101, None)) and pool.refused == 1


def test_an_mxfp8_pool_serves_only_requests_that_accept_approximate_state(model):
    cfg = dict(model=str(model), num_swa_slots=2, max_num_seqs=2, host_swa_bytes=64 << 20)
    exact = EngineCore(EngineConfig(**cfg, host_swa_format="mxfp8"))
    follow, tokens, last = _conversation(exact, 120)  # 650 + 120 tokens: a third full block
    assert last.cached_tokens == 512 - 124 and not last.bounded_replay  # replayed, not lossy
    assert exact.stats().extra["swa_slot_hits_host"] == 0
    native = EngineCore(EngineConfig(**cfg))
    assert tokens == _conversation(native, 120)[1]

    lossy = EngineCore(EngineConfig(**cfg, host_swa_format="mxfp8", swa_replay="bounded"))
    follow, approx, last = _conversation(lossy, 120)
    assert last.cached_tokens == 600 + 19 and last.bounded_replay  # marked approximate
    assert lossy.stats().extra["swa_slot_hits_host"] == 1
    # nothing computed from it is published: turn 2's third block, filled from the lossy
    # state, stays out of the prefix cache (the exact run publishes its own)
    mine = chain_hashes((follow + approx)[:768], 256, lossy.extra_keys)
    assert mine[1] in set(lossy.cached_hashes()) and mine[2] not in set(lossy.cached_hashes())
    theirs = chain_hashes((follow + tokens)[:768], 256, native.extra_keys)
    assert theirs[2] in set(native.cached_hashes())
    agree = sum(a == b for a, b in zip(approx, tokens)) / len(tokens)
    print(f"MXFP8 host slot vs native: greedy agreement {agree:.2f} over {len(tokens)} tokens")


def test_a_handed_off_sequence_leaves_its_slot_in_the_host_pool(model):
    """A prefill engine hands the sequence to decode; the conversation's next turn, routed
    back to it, finds the prompt's window state in its host pool."""
    core = EngineCore(EngineConfig(model=str(model), host_swa_bytes=64 << 20))
    first = prompt(600, 3)
    core.add(CoreRequest("p", tuple(first), replace(GREEDY, max_tokens=50)))
    while not core.step():  # the prefill, up to its first token
        pass
    payload = core.export_sequence("p")
    host = core.host_slots
    assert payload and host is not None and len(host) == 0  # saved by the next step
    _run(core, "other", prompt(40, 4), n=2)
    assert core.stats().extra["host_swa_saved"] >= 1
    (entry,) = [e for e in host.entries() if e.num_tokens == 600]
    assert entry.tail == tuple(first[512:600]) and entry.tail_payload is not None
