"""`engine.spec.profiling`: the step profile is measured on text, so that the verification
steps it prices accept drafts as serving does (and cost what they cost then)."""

from __future__ import annotations

from pathlib import Path

from engine.spec.profiling import _prompts, measure_spec_profile

MODEL = Path(__file__).resolve().parents[4] / "models" / "trained"


def test_the_profile_is_measured_on_held_out_text() -> None:
    prof = measure_spec_profile(
        MODEL, batches=(1, 2), drafted=2, prompt_tokens=64, warmup=1, steps=2, rounds=1
    )
    assert prof.batch == (1, 2) and prof.drafts == (0, 1, 2)
    assert prof.meta["prompts"] == "heldout-v1 windows"
    assert all(s > 0 for row in prof.seconds for s in row) and all(s > 0 for s in prof.plain)


def test_prompts_are_text_where_the_tokenizer_reads_it_else_random(tmp_path) -> None:
    text, source = _prompts(MODEL, 3, 32, seed=0)
    assert source == "heldout-v1 windows" and len(text) == 3 and all(len(p) == 32 for p in text)
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "bos_token_id": 0, "eos_token_id": 1}')
    rand, source = _prompts(tmp_path, 3, 32, seed=0)  # no tokenizer.json
    assert source.startswith("random tokens") and all(3 <= t < 100 for p in rand for t in p)
