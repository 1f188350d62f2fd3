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
