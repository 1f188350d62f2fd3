import numpy as np
import pytest

from router.tiers import TierConfig, TierPlanner, apportion


def planner(n=8, **kw):
    return TierPlanner(TierConfig(round_s=10.0, **kw), n)


def close_round(p, demand, now, work=None):
    for tier, seconds in enumerate(demand):
        p.record(tier, seconds)
    return p.maybe_rebalance(now, np.zeros(p.num_engines) if work is None else np.asarray(work, dtype=float))


def test_tier_boundaries_follow_deepseek():
    p = planner()
    assert [p.tier_of(n) for n in (1, 16_383, 16_384, 65_535, 65_536, 262_143, 262_144, 10**6)] == [
        0, 0, 1, 1, 2, 2, 3, 3,
    ]  # fmt: skip


def test_apportion_is_proportional_and_keeps_every_active_tier():
    assert apportion(np.array([1.0, 1.0, 2.0, 0.0]), 8).tolist() == [2, 2, 4, 0]
    assert apportion(np.array([100.0, 1.0, 0.0, 0.0]), 8).tolist() == [7, 1, 0, 0]
    assert apportion(np.array([0.0, 0.0, 0.0, 0.0]), 8).tolist() == [0, 0, 0, 0]


def test_engines_follow_previous_round_demand_share():
    p = planner(min_dwell_rounds=1)
    p.maybe_rebalance(0.0, np.zeros(8))  # opens round 0; no history: every engine serves every tier
    assert len(p.engines_of(0)) == 8 and len(p.engines_of(2)) == 8
    assert close_round(p, [1.0, 1.0, 2.0, 0.0], now=10.0)
    assert p.counts().tolist() == [2, 2, 4, 0]
    # a >=256K request with no engine of its own goes to the nearest tier that has some
    assert set(p.serving_engines(3).tolist()) == set(p.engines_of(2).tolist())
    # demand shifts to short requests: engines move after the next round
    assert close_round(p, [6.0, 1.0, 1.0, 0.0], now=20.0)
    assert p.counts().tolist() == [6, 1, 1, 0]


def test_hysteresis_keeps_allocation_for_small_changes():
    p = planner(hysteresis=0.25)
    p.maybe_rebalance(0.0, np.zeros(8))
    close_round(p, [1.0, 1.0, 2.0, 0.0], now=10.0)  # [2, 2, 4, 0]
    before = p.engine_tier.copy()
    # target for tier 2 is 8 * 0.44 = 3.5: 0.5 engine off, inside the 0.75 band -> nothing moves
    assert not close_round(p, [1.1, 1.15, 1.8, 0.0], now=20.0)
    assert (p.engine_tier == before).all() and p.moves == 0


def test_dwell_time_stops_thrash_between_rounds():
    p = planner(hysteresis=0.0, min_dwell_rounds=3)
    p.maybe_rebalance(0.0, np.zeros(8))
    close_round(p, [1.0, 1.0, 0.0, 0.0], now=10.0)  # [4, 4, 0, 0], all engines just moved
    # demand swings back and forth; engines inside their dwell time stay put
    assert not close_round(p, [3.0, 1.0, 0.0, 0.0], now=20.0)
    assert p.counts().tolist() == [4, 4, 0, 0]
    # after the dwell time the move happens
    close_round(p, [3.0, 1.0, 0.0, 0.0], now=30.0)
    assert close_round(p, [3.0, 1.0, 0.0, 0.0], now=40.0)
    assert p.counts().tolist() == [6, 2, 0, 0]


def test_starved_tier_gets_an_engine_even_inside_dwell():
    p = planner(hysteresis=0.0, min_dwell_rounds=100)
    p.maybe_rebalance(0.0, np.zeros(8))
    close_round(p, [1.0, 0.0, 0.0, 0.0], now=10.0)  # all 8 on tier 0
    assert close_round(p, [1.0, 0.0, 0.0, 1.0], now=20.0)
    assert p.counts()[3] >= 1


def test_least_loaded_engines_move():
    p = planner(hysteresis=0.0, min_dwell_rounds=0)
    p.maybe_rebalance(0.0, np.zeros(8))
    close_round(p, [1.0, 0.0, 0.0, 0.0], now=10.0)
    work = np.array([5.0, 0.1, 5.0, 5.0, 0.2, 5.0, 5.0, 5.0])
    close_round(p, [3.0, 1.0, 0.0, 0.0], now=20.0, work=work)
    assert sorted(p.engines_of(1).tolist()) == [1, 4]


def test_config_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        TierConfig(boundaries=(10, 5))
    with pytest.raises(ValueError, match="round_s"):
        TierConfig(round_s=0)
