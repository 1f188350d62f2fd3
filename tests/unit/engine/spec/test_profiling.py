"""`engine.spec.profiling`: the step profile is measured on text, so that the verification
steps it prices accept drafts as serving does (and cost what they cost then)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest

from engine.prompts import phase_period, random_prompts, staggered
from engine.spec.profiling import _prompts, measure_spec_profile

MODEL = Path(__file__).resolve().parents[4] / "models" / "trained"


def test_the_profile_is_measured_on_held_out_text(monkeypatch) -> None:
    from engine.core import EngineCore

    engines: list[weakref.ref] = []  # every engine the profile builds
    init = EngineCore.__init__

    def tracked(self, *args, **kwargs) -> None:
        engines.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(EngineCore, "__init__", tracked)
    prof = measure_spec_profile(
        MODEL, batches=(1, 2), drafted=2, prompt_tokens=64, warmup=1, steps=2, rounds=1
    )
    assert prof.batch == (1, 2) and prof.drafts == (0, 1, 2)
    assert prof.meta["prompts"] == "heldout-v1 windows, 64 - (k mod 128) ids"
    assert all(s > 0 for row in prof.seconds for s in row) and all(s > 0 for s in prof.plain)
    # the step in which one request verifies one draft: at one request, k = 1's own cell
    assert len(prof.first_verified) == 2 and prof.first_verified[0] == prof.seconds[0][1]
    assert prof.first_verified[1] > 0
    # every cell's engine is freed before the next is built (at DeepSeek-V4-Flash's widths two
    # engines' weights do not fit one GPU): none outlives the profile
    assert len(engines) == 2 * 5 + 1 and all(ref() is None for ref in engines)


def test_a_step_that_captured_a_graph_is_neither_warm_up_nor_timed(monkeypatch) -> None:
    """A cell's engine captures its CUDA graphs in its first steps of each shape; a capture
    (and the step around it) is what a shape costs once in an engine's life, so such a step
    counts neither towards the warm-up nor among the timed steps (as in `sluice bench spec`'s
    runs). Here three decode steps "capture" and take 0.2 s more, two during the warm-up and
    one among the timed steps: the cell's median leaves them out, and runs three more steps."""
    import time

    from engine.core import EngineCore
    from engine.spec import profiling

    step = EngineCore.step
    calls = {"steps": 0, "captures": 0}

    def capturing(self: EngineCore) -> object:
        calls["steps"] += 1
        out = step(self)
        if calls["steps"] in (2, 4, 7):  # step 1 is the prefill
            calls["captures"] += 1
            time.sleep(0.2)
        return out

    monkeypatch.setattr(EngineCore, "step", capturing)
    monkeypatch.setattr(profiling, "graph_captures", lambda core: calls["captures"])
    prompts, _ = _prompts(MODEL, 1, 32, seed=0)
    t = profiling._cell(MODEL, 1, 0, 0, prompts, warmup=2, steps=3, engine_kwargs={})
    assert t < 0.1  # a 2-core VM's plain step of the trained preset takes ~20 ms
    assert calls["steps"] == 1 + 2 + 3 + 3  # the prefill, the warm-up, the timed, the captures


def test_prompts_are_text_where_the_tokenizer_reads_it_else_random(tmp_path) -> None:
    text, source = _prompts(MODEL, 3, 32, seed=0)
    assert source == "heldout-v1 windows, 32 - (k mod 128) ids" and [len(p) for p in text] == [32, 31, 30]
    config = json.loads((MODEL / "config.json").read_text()) | {"vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rand, source = _prompts(tmp_path, 3, 32, seed=0)  # no tokenizer.json
    assert source.startswith("random tokens") and all(3 <= t < 100 for p in rand for t in p)


def test_staggered_prompts_spread_every_compression_phase_and_refuse_what_they_cannot() -> None:
    """Prompt k loses k mod period ids (a prefix of itself), so a batch's positions cover every
    phase of every compression rate; too short a prompt is refused, never wrapped around."""
    period = phase_period(MODEL)
    assert period == 128  # the trained preset's rates: 4 and 128
    prompts = random_prompts(1024, 200, 300, seed=3)
    out = staggered(prompts, period)
    assert [len(p) for p in out] == [300 - k % period for k in range(200)]
    assert all(p[: len(q)] == q for p, q in zip(prompts, out))
    assert {len(q) % period for q in out[:period]} == set(range(period))
    assert {len(q) % 4 for q in out[:8]} == set(range(4))
    with pytest.raises(ValueError, match="too short"):
        staggered(random_prompts(1024, 40, 30, seed=3), period)
    with pytest.raises(ValueError, match="period"):
        staggered(prompts, 0)


def test_rounds_are_interleaved_across_cells_and_models_and_each_cell_keeps_its_fastest(monkeypatch) -> None:
    """Round r measures every cell of every model before round r + 1 starts, so a machine that
    drifts slows a round of every cell alike, not a run of neighbouring cells or one depth's
    whole table; each cell keeps its fastest round, and every round is reported."""
    from engine.spec import profiling

    calls: list[tuple[str, int, int, int, int | None]] = []

    def fake_cell(model, b, k, d, prompts, warmup, steps, engine_kwargs, verifying=None) -> float:
        calls.append((model.name, b, k, d, verifying))
        slow = len(calls) <= 2 * 11  # the whole first round drifts: 3x as slow
        return (1 + b + 10 * k + 100 * d + (1000 if model.name == "b" else 0)) * 1e-6 * (3 if slow else 1)

    monkeypatch.setattr(profiling, "_cell", fake_cell)
    monkeypatch.setattr(profiling, "_prompts", lambda model, n, length, seed: ([[1, 2]], "text"))
    out = profiling.measure_spec_profiles(
        {"a": Path("a"), "b": Path("b")}, batches=(1, 4), drafted=2, rounds=2
    )
    per_round = len(profiling._cells((1, 4), 2))  # batch 1: 5 cells; batch 4: 6 (one request verifying)
    assert per_round == 11 and len(calls) == 2 * 2 * per_round
    assert [c[0] for c in calls] == (["a"] * per_round + ["b"] * per_round) * 2
    assert calls[: 2 * per_round] == calls[2 * per_round :]  # the same cells, in the same order
    a, b = out["a"], out["b"]
    assert a.seconds[1] == pytest.approx(tuple((1 + 4 + 10 * k + 200) * 1e-6 for k in range(3)))
    assert b.plain[0] == pytest.approx((1 + 1 + 1000) * 1e-6)
    assert a.first_verified == pytest.approx(((1 + 1 + 10 + 200) * 1e-6, (1 + 4 + 10 + 200) * 1e-6))
    assert a.meta["round_ms"]["b4 2 of 2 drafts verified"] == pytest.approx([0.675, 0.225])
    assert a.meta["interleaved"] and len(a.meta["round_ms"]) == per_round
