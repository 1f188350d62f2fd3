"""The drifting Zipf load generator and the window/period simulation."""

from __future__ import annotations

import numpy as np
import pytest

from router.eplb import PlacementSpec, register_algorithm
from router.eplb.deepseek import deepseek_global
from router.eplb.loadgen import DriftingZipfLoads, LoadGenConfig
from router.eplb.simulate import RecordedLoads, SimConfig, simulate

SEEN: list[np.ndarray] = []


@register_algorithm("test_recording_global")
def _recording(load, spec, previous=None):  # records what the simulation shows the algorithm
    SEEN.append(load.copy())
    return deepseek_global(load, spec)


def test_generator_is_deterministic_and_counts_are_consistent() -> None:
    cfg = LoadGenConfig(num_experts=32, num_layers=3, top_k=4, tokens_per_step=500, skew=1.5, seed=5)
    a = DriftingZipfLoads(cfg).counts(np.arange(10))
    b = DriftingZipfLoads(cfg).counts(np.arange(10))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (10, 3, 32)
    assert (a.sum(-1) == 500 * 4).all()
    # top-k picks distinct experts: no expert exceeds the token count, even at high skew
    assert a.max() <= 500 * 1.15  # multinomial noise around a capped mean of 500
    assert not np.array_equal(
        a, DriftingZipfLoads(LoadGenConfig(**{**vars(cfg), "seed": 6})).counts(np.arange(10))
    )


def test_skew_and_drift_parameters_do_what_they_say() -> None:
    def hot_ratio(skew: float) -> float:
        g = DriftingZipfLoads(LoadGenConfig(skew=skew, layer_spread=0.0, seed=1))
        p = g.popularity(np.array([0]))[0]
        return float((p.max(-1) * 256).mean())

    assert 1.0 < hot_ratio(0.3) < hot_ratio(0.6) < hot_ratio(1.0)
    g = DriftingZipfLoads(LoadGenConfig(drift_period_steps=1000, seed=2))
    p = g.popularity(np.array([0, 10, 250]))  # [3, L, E]
    top = [set(np.argsort(-p[i, 0])[:10].tolist()) for i in range(3)]
    assert len(top[0] & top[1]) >= 8  # 1% of a drift period: nearly the same hot set
    assert len(top[0] & top[2]) <= 5  # a quarter period: mostly different experts
    # per-layer variation: layers differ in skew
    assert np.ptp(DriftingZipfLoads(LoadGenConfig(layer_spread=0.3)).layer_skew) > 0.05


def test_generator_validation() -> None:
    with pytest.raises(ValueError, match="top_k"):
        LoadGenConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="drift_period_steps"):
        LoadGenConfig(drift_period_steps=0)


def test_simulation_places_from_the_preceding_window_only() -> None:
    # step t has load (t + 1) on expert (t // 10) % 4 only: each window is identifiable
    steps, experts = 70, 4
    counts = np.zeros((steps, 1, experts), dtype=np.int64)
    counts[np.arange(steps), 0, (np.arange(steps) // 10) % experts] = np.arange(steps) + 1
    spec = PlacementSpec(experts, 2, 1)
    cfg = SimConfig(
        spec,
        window=5,
        period=20,
        total_steps=steps,
        algorithms=("test_recording_global",),
        static_algorithm="test_recording_global",
    )
    SEEN.clear()
    res = simulate(RecordedLoads(counts), cfg)
    # placements at T = 5, 25, 45, 65 from steps [0,5), [20,25), [40,45), [60,65); static at T=5 reuses it
    assert res.placements == 4 and len(SEEN) == 4
    for got, t in zip(SEEN, (5, 25, 45, 65)):
        want = np.zeros(experts)
        for s in range(t - 5, t):
            want[(s // 10) % experts] += s + 1
        np.testing.assert_array_equal(got[0], want)
    assert res.eval_steps == steps - 5


def test_simulation_policies_on_drifting_skewed_loads() -> None:
    gen = LoadGenConfig(
        num_experts=32,
        num_layers=2,
        tokens_per_step=4096,
        skew=0.8,
        drift_period_steps=4000,
        burst_sigma=0.05,
        seed=0,
    )
    spec = PlacementSpec(32, 4, 2)
    cfg = SimConfig(
        spec,
        window=50,
        period=200,
        total_steps=1250,
        algorithms=("deepseek_global", "waterfill_swap"),
        static_algorithm="waterfill_swap",
        eval_stride=2,
    )
    res = simulate(DriftingZipfLoads(gen), cfg)
    imb = res.imbalance
    assert set(imb) == {"none", "static", "eplb:deepseek_global", "eplb:waterfill_swap"}
    assert imb["eplb:waterfill_swap"] < imb["none"] - 0.1  # balancing matters on skewed loads
    assert imb["eplb:waterfill_swap"] < imb["static"]  # re-placement tracks the drift
    assert imb["eplb:waterfill_swap"] <= imb["eplb:deepseek_global"] + 0.01
    assert all(v >= 1.0 for v in imb.values())


def test_recorded_loads_validation(tmp_path) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        RecordedLoads(np.ones((3, 2)))
    path = tmp_path / "x.npz"
    np.savez(path, other=np.zeros(3))
    with pytest.raises(ValueError, match="no 'counts'"):
        RecordedLoads.load(str(path))
    with pytest.raises(ValueError, match="longer than period"):
        SimConfig(
            PlacementSpec(4, 2, 0), window=10, period=5, total_steps=100, algorithms=(), static_algorithm="x"
        )
