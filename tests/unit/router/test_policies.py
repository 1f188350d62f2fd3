from dataclasses import replace

import numpy as np
import pytest

from router import cache_aware, sluice  # noqa: F401  (registration)
from router.cache_aware import CacheAware, CacheAwareConfig
from router.policy import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    EngineLoad,
    NoCandidates,
    PolicyContext,
    RequestView,
)
from router.prefix_index import PrefixIndex, PrefixIndexConfig
from router.sluice import (
    LeastOutstandingWork,
    SluicePrefill,
    SluicePrefillConfig,
    TwoDimConfig,
    TwoDimDecode,
    VisionRequest,
)
from router.tiers import TierConfig

ALL = ["cache_aware", "least_load", "round_robin", "sluice"]


def req(i, n_blocks, prefix=(), arrival=0.0, bs=512):
    blocks = list(prefix) + [("r", i, k) for k in range(n_blocks - len(prefix))]
    return RequestView(i, n_blocks * bs, blocks, arrival, 0, bs)


def ctx(n=4):
    return PolicyContext(n, index=PrefixIndex(PrefixIndexConfig(n)))


def test_registries_hold_the_four_names_and_reject_unknown():
    assert PREFILL_POLICIES.names() == ALL and DECODE_POLICIES.names() == ALL
    with pytest.raises(ValueError, match="known: cache_aware, least_load, round_robin, sluice"):
        PREFILL_POLICIES.create("random", ctx())


@pytest.mark.parametrize("name", ALL)
def test_every_policy_refuses_empty_candidates_and_picks_a_candidate(name):
    for reg in (PREFILL_POLICIES, DECODE_POLICIES):
        p = reg.create(name, ctx())
        with pytest.raises(NoCandidates):
            p.select([], req(0, 2))
        assert all(p.select([1, 3], req(i, 2)) in (1, 3) for i in range(1, 6))


def test_round_robin_cycles_and_least_load_balances_tokens():
    rr = PREFILL_POLICIES.create("round_robin", ctx())
    assert [rr.select([0, 1, 2, 3], req(i, 1)) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    ll = PREFILL_POLICIES.create("least_load", ctx())
    big, small = req(0, 40), req(1, 1)
    assert ll.select([0, 1], big) == 0
    assert ll.select([0, 1], small) == 1 and ll.select([0, 1], req(2, 1)) == 1
    ll.on_complete(0, big)
    assert ll.select([0, 1], req(3, 1)) == 0


def test_cache_aware_follows_prefix_until_imbalance_threshold():
    p = CacheAware(ctx(2), CacheAwareConfig(balance_abs_threshold=3, balance_rel_threshold=1.5))
    shared = [("s", k) for k in range(8)]
    first = p.select([0, 1], req(0, 10, shared))
    # a new prompt with no match goes to the smaller tree, the shared prefix sticks
    assert p.select([0, 1], req(1, 10)) == 1 - first
    assert all(p.select([0, 1], req(i, 10, shared)) == first for i in range(2, 6))
    # now `first` has 5 in flight vs 1: imbalance (> 3 and > 1.5x) -> shortest queue wins
    assert p.select([0, 1], req(9, 10, shared)) == 1 - first


def test_sluice_prefers_cached_engine_but_not_at_any_queue():
    c = ctx(2)
    p = SluicePrefill(c, SluicePrefillConfig(use_tiers=False, recompute_weight=2.0))
    shared = [("s", k) for k in range(30)]
    c.index.apply_stored(1, shared)
    assert p.select([0, 1], req(0, 32, shared)) == 1  # 30 of 32 blocks cached on engine 1
    p.busy_until[1] = 100.0  # engine 1 swamped: recompute elsewhere is cheaper than waiting
    assert p.select([0, 1], req(1, 32, shared)) == 0
    # its blocks were inserted optimistically: the next turn of that conversation follows it
    assert c.index.match(list(shared) + [("r", 1, k) for k in range(2)]).tolist() == [32, 30]


def test_sluice_keeps_short_requests_off_the_long_tier():
    c = ctx(2)
    cfg = SluicePrefillConfig(tiers=TierConfig(round_s=1.0), cross_tier_factor=0.5)
    p = SluicePrefill(c, cfg)
    p.select([0, 1], req(0, 4, arrival=0.0))  # opens round 0
    p.planner.record(0, 1.0)
    p.planner.record(1, 1.0)
    p.select([0, 1], req(1, 4, arrival=1.5))  # closes round 0: one engine per tier
    short_e, long_e = int(p.planner.engines_of(0)[0]), int(p.planner.engines_of(1)[0])
    # busy_until is each engine's predicted drain time (seconds on the arrival clock)
    p.busy_until[:] = 0.0
    p.busy_until[short_e] = 1.6 + 0.01  # slightly busier, yet still the short tier's engine
    assert p.select([0, 1], req(2, 4, arrival=1.6)) == short_e
    p.busy_until[:] = 0.0
    p.busy_until[long_e] = 1.7 + 0.1
    assert p.select([0, 1], req(3, 60, arrival=1.7)) == long_e  # 30K tokens: tier 1
    # but an idle engine of the other tier beats a long queue in one's own (work conserving)
    p.busy_until[short_e] = 1.8 + 5.0
    p.busy_until[long_e] = 0.0
    assert p.select([0, 1], req(4, 4, arrival=1.8)) == long_e


def test_sluice_wait_is_a_virtual_clock_reanchored_by_engine_reports():
    c = ctx(2)
    p = SluicePrefill(c, SluicePrefillConfig(use_tiers=False))
    a = req(0, 64, arrival=0.0)  # 32K tokens, ~0.6 s of prefill
    e = p.select([0, 1], a)
    work = c.cost.prefill_time(a.input_len)
    assert p.wait(np.array([e]))[0] == pytest.approx(work)
    # half of it has elapsed by the next arrival: only the rest is waiting time
    p.select([0, 1], req(1, 1, arrival=work / 2))
    assert p.wait(np.array([e]))[0] == pytest.approx(work / 2)
    # the engine reports 3 s of queued work: the clock re-anchors on it
    p.update_loads([EngineLoad(e, queued_work_s=3.0)])
    assert p.wait(np.array([e]))[0] == pytest.approx(3.0)


def test_sluice_breaks_score_ties_on_requests_in_flight():
    """Idle engines with no hits score alike; the one running fewer requests wins, not index 0."""
    c = ctx(3)
    p = SluicePrefill(c, SluicePrefillConfig(use_tiers=False))
    p.update_loads([EngineLoad(0, running=2), EngineLoad(1, running=1), EngineLoad(2, running=1)])
    assert p.select([0, 1, 2], req(0, 1, arrival=0.0)) == 1  # 1 and 2 tie; lower index
    # later, with every clock drained, the scores tie again: engine 1 now runs 2 requests, 2 runs 1
    assert p.select([0, 1, 2], req(1, 1, arrival=100.0)) == 2


def test_decode_2d_normalized_rule_short_to_low_concurrency_long_to_small_cache():
    d = TwoDimDecode(PolicyContext(2), TwoDimConfig(rule="normalized"))
    # engine 0: few requests holding long caches; engine 1: many short requests
    d.update_loads([EngineLoad(0, running=2, kv_tokens=200_000), EngineLoad(1, running=12, kv_tokens=24_000)])
    short = RequestView("s", 500)
    long = RequestView("l", 100_000)
    assert d.select([0, 1], short) == 0
    d.on_complete(0, short)
    assert d.select([0, 1], long) == 1


def test_decode_2d_skips_engines_without_kv_room():
    d = TwoDimDecode(PolicyContext(2))
    d.update_loads(
        [
            EngineLoad(0, running=0, kv_tokens=90_000, kv_capacity=100_000),
            EngineLoad(1, running=50, kv_tokens=0),
        ]
    )
    assert d.select([0, 1], RequestView("x", 20_000)) == 1


def test_least_load_decode_uses_reported_kv():
    d = DECODE_POLICIES.create("least_load", PolicyContext(2))
    d.update_loads([EngineLoad(0, running=1, kv_tokens=50_000), EngineLoad(1, running=5, kv_tokens=1_000)])
    assert d.select([0, 1], RequestView("x", 10)) == 1


def test_vision_least_outstanding_work():
    v = LeastOutstandingWork(3)
    a = VisionRequest("a", 4000)
    assert v.select([0, 1, 2], a) == 0
    assert v.select([0, 1, 2], VisionRequest("b", 100)) == 1
    assert v.select([0, 1, 2], VisionRequest("c", 100)) == 2
    assert v.select([0, 1, 2], VisionRequest("d", 100)) == 1
    v.on_complete(0, a)
    assert v.select([0, 1, 2], VisionRequest("e", 100)) == 0
    assert np.isclose(v.work.sum(), 400)


def test_request_view_rejects_empty_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        RequestView("x", 0)


def test_sluice_counts_store_hits_with_their_fetch_cost():
    c = ctx(2)
    shared = [("s", k) for k in range(60)]
    c.index.store_add(shared)
    c.index.apply_stored(1, shared[:10])
    blind = SluicePrefill(c, SluicePrefillConfig(use_tiers=False))
    aware = SluicePrefill(c, SluicePrefillConfig(use_tiers=False, store_fetch_s_per_block=1e-3))
    r = req(0, 64, shared)
    _, pred_blind, _ = blind.scores(np.array([0, 1]), r)
    _, pred_aware, _ = aware.scores(np.array([0, 1]), r)
    n = r.input_len
    assert pred_blind[0] == pytest.approx(c.cost.prefill_time(n))
    assert pred_aware[0] == pytest.approx(c.cost.prefill_time(n, 60 * 512) + 60e-3)
    assert pred_aware[1] == pytest.approx(c.cost.prefill_time(n, 60 * 512) + 50e-3)
    # with everything in the store, affinity matters only by the fetch it saves
    aware.busy_until[1] = 1.0
    assert aware.select([0, 1], r) == 0


def test_a_hit_costs_its_window_replay():
    """A hit is worth its tokens less the window replay the engine runs to rebuild the SWA
    state (exact: layers x (window - 1), bounded: window - 1); a hit no longer than the
    replay is worth nothing (the engine recomputes the prompt)."""
    free = RequestView("a", 8192, [("s", k) for k in range(32)], block_size=256)
    exact = replace(free, swa_replay_tokens=43 * 127)
    bounded = replace(free, swa_replay_tokens=127)
    assert [v.cached_tokens(8) for v in (free, exact, bounded)] == [2048, 0, 2048 - 127]
    assert exact.cached_tokens(32) == 8192 - 43 * 127
    with pytest.raises(ValueError, match="swa_replay_tokens"):
        replace(free, swa_replay_tokens=-1)
    c = ctx(2)
    c.index.apply_stored(1, [("s", k) for k in range(8)])
    p = SluicePrefill(c, SluicePrefillConfig(use_tiers=False))
    n = free.input_len
    for view, hit in ((free, 2048), (exact, 0), (bounded, 2048 - 127)):
        _, pred, _ = p.scores(np.array([0, 1]), view)
        assert pred[1] == pytest.approx(c.cost.prefill_time(n, hit)), view.swa_replay_tokens
