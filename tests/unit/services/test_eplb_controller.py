"""The EPLB controller's policy core: config, timing, decisions, layer-by-layer commits."""

from __future__ import annotations

import numpy as np
import pytest

from router.eplb.transfer import plan_remap
from services.eplb.controller import EplbConfig, EplbController


def test_pool_defaults_are_deepseeks_and_validation_is_actionable() -> None:
    pre, dec = EplbConfig.for_pool("prefill"), EplbConfig.for_pool("decode")
    assert (pre.num_redundant_per_rank, pre.window_steps, pre.period_steps) == (4, 100, 1000)
    assert (dec.num_redundant_per_rank, dec.window_steps, dec.period_steps) == (1, 1000, 10000)
    with pytest.raises(ValueError, match="known: .*waterfill_swap"):
        EplbConfig.for_pool("decode", algorithm="magic")
    with pytest.raises(ValueError, match="window_steps <= period_steps"):
        EplbConfig.for_pool("prefill", window_steps=2000)
    with pytest.raises(ValueError, match="unknown eplb setting"):
        EplbConfig.from_mapping("prefill", {"windw_steps": 10})
    with pytest.raises(ValueError, match="pool must be one of"):
        EplbConfig.for_pool("vision")
    cfg = EplbConfig.from_mapping("decode", {"period_steps": 5000, "algorithm": "deepseek_global"})
    assert cfg.period_steps == 5000 and cfg.window_steps == 1000
    assert cfg.spec(256, 64).num_nodes == 8 and cfg.spec(256, 4).num_nodes == 1


def _windows(rng: np.random.Generator, ranks: int, steps: int, layers: int, experts: int, hot: int) -> list:
    p = np.full(experts, 1.0)
    p[hot] = 12.0
    p /= p.sum()
    return [rng.multinomial(20000, p, size=(steps, layers)) for _ in range(ranks)]


def test_decision_timing_and_layer_by_layer_commit() -> None:
    cfg = EplbConfig.for_pool(
        "prefill", num_redundant_per_rank=1, window_steps=10, period_steps=50, min_gain=0.02
    )
    ctl = EplbController(cfg, num_layers=3, num_logical=8, num_ranks=2)
    assert ctl.placement.phy2log.shape == (3, 10)
    assert not ctl.due(9) and ctl.due(10)
    assert ctl.last_imbalance is None
    rng = np.random.default_rng(0)
    dec = ctl.decide(10, _windows(rng, 2, 10, 3, 8, hot=5))
    # the metric the engines export: the window's mean imbalance, served and planned
    assert ctl.last_imbalance == pytest.approx(
        (
            np.mean([lr.window_imbalance_before for lr in dec.layers]),
            np.mean([lr.window_imbalance_after for lr in dec.layers]),
        )
    )
    assert ctl.last_imbalance[1] < ctl.last_imbalance[0]
    assert [lr.layer for lr in dec.layers] == [0, 1, 2]  # the hot expert 5 forces a change
    assert [len(b) for b in dec.batches()] == [1, 1, 1]
    for lr in dec.layers:
        assert lr.window_imbalance_after < lr.window_imbalance_before
        assert np.count_nonzero(lr.new_phy2log == 5) == 3  # hot expert takes both redundant slots
        assert lr.plan == plan_remap(ctl.placement.phy2log[lr.layer], lr.new_phy2log, 2)
    assert ctl.remap_in_flight and not ctl.due(1000)
    with pytest.raises(ValueError, match="not committed"):
        ctl.decide(1000, _windows(rng, 2, 10, 3, 8, hot=5))
    ctl.commit_layer(0)
    np.testing.assert_array_equal(ctl.placement.phy2log[0], dec.layers[0].new_phy2log)
    assert not np.array_equal(ctl.placement.phy2log[1], dec.layers[1].new_phy2log)  # not yet switched
    ctl.commit_layer(1)
    ctl.commit_layer(2)
    with pytest.raises(ValueError, match="no remap in flight"):
        ctl.commit_layer(2)
    assert not ctl.due(59) and ctl.due(60)  # the period counts from the decision
    # the same hot expert again: sampling noise alone is not worth moving weights for
    again = ctl.decide(60, _windows(rng, 2, 10, 3, 8, hot=5))
    assert again.layers == () and ctl.due(110)


def test_min_gain_and_disabled_and_shape_checks() -> None:
    rng = np.random.default_rng(1)
    cfg = EplbConfig.for_pool("decode", window_steps=5, period_steps=5, min_gain=10.0)
    ctl = EplbController(cfg, num_layers=2, num_logical=8, num_ranks=4)
    assert ctl.decide(5, _windows(rng, 4, 5, 2, 8, hot=0)).layers == ()  # gain below min_gain
    off = EplbController(EplbConfig.for_pool("decode", enabled=False), 2, 8, 4)
    assert not off.due(10**9)
    with pytest.raises(ValueError, match="expected"):
        ctl.window_load([np.zeros((5, 3, 8))])
    # windows longer than the configured window only count their last window_steps steps
    long = np.zeros((9, 2, 8))
    long[-5:] = 1.0
    long[:4] = 100.0
    assert ctl.window_load([long]).sum() == 5 * 2 * 8


def test_config_from_the_cluster_spec_example() -> None:
    from pathlib import Path

    from services.ray.cluster_spec import load_cluster_spec

    spec = load_cluster_spec(Path(__file__).parents[3] / "deploy" / "cluster.example.yaml")
    pre = EplbConfig.from_cluster_spec("prefill", spec.prefill.eplb)
    dec = EplbConfig.from_cluster_spec("decode", spec.decode.eplb, min_gain=0.01)
    assert (pre.num_redundant_per_rank, pre.window_steps, pre.period_steps) == (4, 100, 1000)
    assert (dec.num_redundant_per_rank, dec.window_steps, dec.period_steps, dec.min_gain) == (
        1,
        1000,
        10000,
        0.01,
    )
    assert pre.algorithm == "sluice"  # the spec's default name resolves in the registry
    ctl = EplbController(pre, num_layers=1, num_logical=16, num_ranks=4)
    rng = np.random.default_rng(0)
    assert ctl.decide(100, _windows(rng, 4, 100, 1, 16, hot=3)).layers
