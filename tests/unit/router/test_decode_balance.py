"""Decode balance: the measured step table, the grader, the generated traces, the decode rule."""

import json
import math

import numpy as np
import pytest

from costmodel import DecodeCostModel
from router.evaluate import decode_stress, grade_decode, peak_decode_throughput
from router.gen_traces import (
    BLOCK,
    AgentParams,
    LongDocsParams,
    agents,
    describe,
    long_documents,
    prefix_reuse,
    write_jsonl,
)
from router.policy import EngineLoad, PolicyContext, RequestView
from router.sim import SimConfig
from router.sluice import TwoDimConfig, TwoDimDecode
from router.steptable import DEFAULT_TABLE, StepTable, table_from_model
from router.trace import load_trace

LINEAR = DecodeCostModel(d0=0.004, d1=2e-4, d2=6e-8)
GRID_B = (1, 4, 16, 64, 256)
GRID_K = (0, 1e6, 4e6, 8e6)


# ---------------------------------------------------------------- the step table
def test_bilinear_table_reproduces_a_linear_model_inside_and_outside_the_grid():
    t = table_from_model(LINEAR, GRID_B, GRID_K)
    for b, k in [(1, 0), (3, 5e5), (100, 3.3e6), (256, 8e6), (300, 9e6), (2, 1.2e7)]:
        assert t.step_time(b, k) == pytest.approx(LINEAR.step_time(b, k), rel=1e-9)
    b = np.array([[0, 5, 17], [256, 1, 0]])
    k = np.array([[1e5, 2e6, 7e6], [8e6, 0, 0]])
    vec = t.step_times(b, k)
    assert vec.shape == (2, 3)
    assert vec[0, 0] == 0.0 and vec[1, 2] == 0.0  # nothing running: no step
    assert vec[0, 1] == pytest.approx(t.step_time(5, 2e6))


def test_table_interpolates_a_hand_made_grid_and_round_trips_json(tmp_path):
    t = StepTable((1, 3), (0, 100), np.array([[1.0, 3.0], [2.0, 8.0]]), {"preset": "hand"})
    assert t.step_time(2, 50) == pytest.approx((1 + 3 + 2 + 8) / 4)  # cell centre: mean of corners
    assert t.step_time(1, 100) == 3.0
    path = tmp_path / "t.json"
    path.write_text(t.to_json())
    back = StepTable.load(path)
    assert back.batch == (1, 3) and back.meta["preset"] == "hand"
    assert back.step_time(2, 50) == t.step_time(2, 50)
    with pytest.raises(ValueError, match="increasing"):
        StepTable((3, 1), (0, 100), np.ones((2, 2)))
    with pytest.raises(ValueError, match="not found"):
        StepTable.load(tmp_path / "missing.json")


def test_fit_recovers_the_model_and_can_skip_unreachable_cells():
    t = table_from_model(LINEAR, GRID_B, GRID_K)
    f = t.fit()
    assert (f.d0, f.d1, f.d2) == pytest.approx((LINEAR.d0, LINEAR.d1, LINEAR.d2), rel=1e-6)
    # only cells whose sequences are at most 100K tokens deep on average
    assert all(k / b <= 1e5 for b, k, _ in t.samples(1e5))
    assert len(t.samples(1e5)) < len(t.samples())


def test_committed_table_is_measured_and_fits():
    t = StepTable.load(DEFAULT_TABLE)
    for key in ("preset", "device", "torch", "date", "load_average_before", "command"):
        assert key in t.meta
    assert t.seconds.shape == (len(t.batch), len(t.kv_tokens))
    m = t.fit(262_144)
    assert m.d1 > 0 and m.d2 > 0  # both dimensions cost time on the engine


# ---------------------------------------------------------------- the grader
def test_grader_on_a_hand_made_table():
    # step = 1 s per running sequence + 1 s per 100 KV tokens (exactly bilinear)
    t = StepTable((1, 2), (0, 100), np.array([[1.0, 2.0], [2.0, 3.0]]))
    running = np.array([[1, 1], [2, 0], [0, 0]])  # the last sample: pool idle, not counted
    kv = np.array([[100, 0], [0, 0], [0, 0]])
    g = grade_decode(running, kv, t)
    # step per sample: [[2, 1], [2, 0]] -> per-engine means 2, 0.5
    assert g["step_max_over_mean"] == pytest.approx(2 / 1.25)
    assert g["running_max_over_mean"] == pytest.approx(1.5 / 1.0)
    assert g["kv_max_over_mean"] == pytest.approx(50 / 25)
    assert g["step_instant_max_over_mean"] == pytest.approx((2 / 1.5 + 2 / 1.0) / 2)
    assert g["step_mean_ms"] == pytest.approx(1e3 * (2 + 1 + 2) / 3)
    even = grade_decode(np.array([[3, 3]]), np.array([[50, 50]]), t)
    assert even["step_max_over_mean"] == even["running_max_over_mean"] == even["kv_max_over_mean"] == 1.0


def test_simulated_engines_step_at_the_table_not_the_router_model():
    truth = table_from_model(DecodeCostModel(d0=0.02, d1=1e-3, d2=1e-7), GRID_B, GRID_K)
    router_model = DecodeCostModel()  # the router's guess: 5 ms steps
    trace = long_documents(0, LongDocsParams(requests=60))
    cfg = SimConfig(num_prefill=2, num_decode=2, decode_cost=router_model, decode_step=truth)
    load, res = decode_stress(trace, cfg, ("round_robin", "sluice"), utilization=0.8, samples=200)
    # the pool is offered 0.8 of its peak decode throughput on the table, not the router's model
    peak, n = peak_decode_throughput(trace, cfg, truth)
    ctx = trace.input_len.mean() + trace.output_len.mean() / 2
    assert peak == pytest.approx(n / truth.step_time(n, n * ctx))
    assert load["peak_tok_s_per_engine"] == peak
    offered = (trace.output_len - 1).sum() / (trace.arrival_s[-1] * load["time_scale"] * cfg.num_decode)
    assert offered == pytest.approx(0.8 * peak)
    for r in res.values():
        assert r["tpot_p50_ms"] > 20.0  # the table's d0 alone; the router model says ~5 ms
        assert r["step_max_over_mean"] >= 1.0 and r["kv_max_over_mean"] >= 1.0


# ---------------------------------------------------------------- generated traces
def test_long_documents_shape_seed_and_fraction():
    p = LongDocsParams(requests=1000)
    a, b, c = long_documents(1, p), long_documents(1, p), long_documents(2, p)
    assert len(a) == 1000 and np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s[0] == 0
    assert np.array_equal(a.input_len, b.input_len) and a.blocks == b.blocks
    assert not np.array_equal(a.input_len, c.input_len)
    long = (a.input_len >= p.long_min) & (a.input_len <= p.long_max)
    assert long.sum() == 100  # exactly 10 %
    assert np.all(a.input_len[~long] < p.long_min)
    assert all(len(bl) == -(-n // BLOCK) for n, bl in zip(a.input_len.tolist(), a.blocks))
    assert len({x for bl in a.blocks for x in bl}) == sum(len(bl) for bl in a.blocks)  # no sharing
    assert np.all(a.output_len >= 2)
    assert describe(a, p)["long_fraction_measured"] == 0.1


def test_agents_shape_seed_turns_and_reuse():
    p = AgentParams(sessions=30, turns=20)
    a, b = agents(3, p), agents(3, p)
    assert len(a) == 600 and a.blocks == b.blocks and np.array_equal(a.arrival_s, b.arrival_s)
    assert a.blocks != agents(4, p).blocks
    sessions: dict[int, list[int]] = {}
    for i, bl in enumerate(a.blocks):
        sessions.setdefault(bl[0], []).append(i)  # every turn starts with the session's first block
    assert sorted(len(v) for v in sessions.values()) == [20] * 30
    for rows in sessions.values():
        for prev, cur in zip(rows, rows[1:]):
            ctx = int(a.input_len[prev] + a.output_len[prev])
            n = int(a.input_len[cur])
            assert n == math.ceil(ctx / p.reuse)  # the previous turn is 95 % of this input
            assert ctx / n <= p.reuse < ctx / (n - 1)
            full = int(a.input_len[prev]) // BLOCK
            assert a.blocks[cur][:full] == a.blocks[prev][:full]  # its full blocks are reused
            assert a.arrival_s[cur] >= a.arrival_s[prev]
    assert 0.85 < prefix_reuse(a) <= p.reuse


def test_generated_traces_round_trip_the_mooncake_format(tmp_path):
    for t in (long_documents(0, LongDocsParams(requests=50)), agents(0, AgentParams(sessions=3, turns=4))):
        path = tmp_path / f"{t.name}.jsonl"
        write_jsonl(t, path)
        row = json.loads(path.read_text().splitlines()[0])
        assert set(row) == {"timestamp", "input_length", "output_length", "hash_ids"}
        back = load_trace(path)
        assert np.array_equal(back.input_len, t.input_len) and back.blocks == t.blocks
        assert np.allclose(back.arrival_s, t.arrival_s, atol=1e-3)


def test_the_bench_generates_every_family_under_its_own_name_with_its_shape_printed():
    from services.bench.router import HOLDOUT_SHAPES, _generated

    config: dict = {}
    families = _generated(1, config)
    names = [f[0].name for f in families]
    assert names == ["long_documents", "agents", "agents_burst", *HOLDOUT_SHAPES]
    for name, params in HOLDOUT_SHAPES.items():  # each differs from the two shapes
        assert params not in (LongDocsParams(), AgentParams())
        assert (
            config["generated_traces"][name]["params"]
            == describe(families[names.index(name)][0], params)["params"]
        )


def test_paired_difference_reports_the_seedwise_gap_and_its_standard_error():
    from services.bench.router import paired_difference

    p = paired_difference([1.00, 1.02, 1.01], [1.01, 1.01, 1.03])
    assert p["mean_diff"] == pytest.approx(-0.02 / 3)
    assert p["stderr"] == pytest.approx(
        0.0152753 / 3**0.5, rel=1e-5
    )  # differences -0.01, 0.01, -0.02: sd 0.01528
    assert (p["seeds"], p["ours_lower_on"]) == (3, 2)
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


# ---------------------------------------------------------------- the decode rule
LOADS = [EngineLoad(0, running=2, kv_tokens=200_000), EngineLoad(1, running=12, kv_tokens=24_000)]


def decode(model, rule="weighted"):
    d = TwoDimDecode(PolicyContext(2, decode_cost=model), TwoDimConfig(rule=rule))
    d.update_loads(LOADS)
    return d


def test_weighted_rule_takes_its_crossover_from_the_model():
    # d1 / d2 = 10K tokens: a request of that much KV costs a step as much as one more request
    m = DecodeCostModel(d0=0.005, d1=1e-4, d2=1e-8)
    assert decode(m).select([0, 1], RequestView("short", 2_000)) == 0  # to few requests
    assert decode(m).select([0, 1], RequestView("long", 100_000)) == 1  # to the small cache
    # KV 100x cheaper (crossover 1M tokens): the same long request now weighs concurrency
    cheap_kv = DecodeCostModel(d0=0.005, d1=1e-4, d2=1e-10)
    assert decode(cheap_kv).select([0, 1], RequestView("long", 100_000)) == 0
    w = 1e-8 * 100_000 / (1e-4 + 1e-8 * 100_000)
    score = decode(m).scores(np.array([0, 1]), 100_000)
    assert score[0] == pytest.approx((1 - w) * 3 / 8 + w * 300_000 / 212_000)


def test_step_time_rule_picks_the_least_predicted_step_after_placement():
    # a request costs 10 us, a token 1.5 ns: engine 1 (12 x 10 + 24K x 1.5e-3 us) steps faster
    assert (
        decode(DecodeCostModel(d0=0.005, d1=10e-6, d2=1.5e-9), "step_time").select(
            [0, 1], RequestView("s", 500)
        )
        == 1
    )
    # a request costs 100 us: engine 0 (few requests, long caches) steps faster
    d = decode(DecodeCostModel(d0=0.005, d1=100e-6, d2=1.5e-9), "step_time")
    pred = d.scores(np.array([0, 1]), 500)  # predicted step seconds after placing it
    assert pred[0] == pytest.approx(0.005 + 3 * 100e-6 + 200_500 * 1.5e-9)
    assert d.select([0, 1], RequestView("s", 500)) == 0


@pytest.mark.parametrize("rule", ["weighted", "step_time"])
def test_decode_rules_balance_a_stream_of_mixed_requests(rule):
    m = DecodeCostModel(d0=0.005, d1=100e-6, d2=1e-9)
    d = TwoDimDecode(PolicyContext(4, decode_cost=m), TwoDimConfig(rule=rule))
    rng = np.random.default_rng(0)
    for i in range(400):
        d.select([0, 1, 2, 3], RequestView(i, int(rng.choice([500, 200_000], p=[0.9, 0.1]))))
    step = [m.step_time(int(r), k) for r, k in zip(d.outstanding, d.outstanding_tokens)]
    assert max(step) / np.mean(step) < 1.05
    for x in (d.outstanding, d.outstanding_tokens):
        assert max(x) / np.mean(x) < (1.1 if rule == "weighted" else 2.0)


def test_marginal_rule_counts_the_slowdown_of_requests_already_there():
    m = DecodeCostModel(d0=0.0, d1=1e-4, d2=1e-8)
    d = TwoDimDecode(PolicyContext(2, decode_cost=m), TwoDimConfig(rule="marginal"))
    # equal predicted steps (20 x 1e-4 + 0 = 2e-3 = 10 x 1e-4 + 100K x 1e-8)
    d.update_loads([EngineLoad(0, running=20, kv_tokens=0), EngineLoad(1, running=10, kv_tokens=100_000)])
    assert d.select([0, 1], RequestView("long", 100_000)) == 1  # slows 10 requests, not 20
    with pytest.raises(ValueError, match="rule"):
        TwoDimConfig(rule="bogus")


# ---------------------------------------------------------------- the profiler
def test_profile_decode_times_the_engine_on_a_small_grid():
    from services.bench.router import profile_decode

    raw = profile_decode("tiny", batches=(1, 2), kv_tokens=(0, 1024), rounds=1, repeats=2, warmup=1, layers=2)
    t = StepTable.from_dict(raw)
    assert t.seconds.shape == (2, 2) and np.all(t.seconds > 0)
    assert raw["kv_tokens_per_sequence"] == [[1, 1024], [1, 512]]
    assert (raw["layers"], raw["device"], raw["dtype"], raw["gpu"]) == (2, "cpu", "float32", None)
    assert raw["decode_graphs"] is False and raw["caches"] == "seeded random entries"
    assert raw["command"].endswith("--layers 2 --kv-tokens 0,1024")  # reruns this grid
    for key in ("preset", "device", "torch", "date", "load_average_before", "load_average_after", "command"):
        assert raw[key]


def test_an_overloaded_pool_stays_balanced_when_queues_report_their_kv():
    """Agents' sessions all started within 200 s: load peaks past the engines' best batch and
    requests queue at the engines. The engines' reports count the KV their queues will hold;
    left out (before 2026-12-03), a queued engine looked free in KV and drew more: `sluice`'s
    step max/mean was 1.88 here, round robin's 1.10."""
    table = StepTable.load()
    cfg = SimConfig(decode_cost=table.fit(262_144), decode_step=table)
    trace = agents(0, AgentParams(session_rate_per_s=2.0))
    _, res = decode_stress(trace, cfg, ("round_robin", "sluice"), utilization=0.9, samples=500)
    assert res["sluice"]["decode_wait_p99_s"] > 10.0  # overloaded: requests do queue
    assert res["sluice"]["step_max_over_mean"] < 1.05
    assert res["sluice"]["step_max_over_mean"] < res["round_robin"]["step_max_over_mean"]
