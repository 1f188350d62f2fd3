"""``EngineConfig.random_weights``: an engine over seeded random weights built on the device
from a weightless model directory (``write_config_dir``), for benchmarks at real widths."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.checkpoint.generate import write_config_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[0, 5, 6, 7, 8], [0, 9, 10]]


def _tokens(model: Path, seed: int) -> tuple[list[list[int]], str]:
    with LLM(model, random_weights=seed, num_blocks=8, num_swa_slots=4, max_num_seqs=4) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        return [o.outputs[0].token_ids for o in outs], llm.core.fingerprint


def test_random_weights_serve_from_a_weightless_directory_deterministically(tmp_path, checkpoint_factory):
    model = write_config_dir("tiny", tmp_path / "tiny-config")
    assert not list(model.glob("*.safetensors")) and (model / "tokenizer.json").is_file()
    a, fp_a = _tokens(model, 7)
    b, fp_b = _tokens(model, 7)
    c, fp_c = _tokens(model, 8)
    assert a == b and fp_a == fp_b and all(len(t) == 6 for t in a)
    assert c != a and fp_c != fp_a  # another seed: other weights, other cache identity
    with LLM(checkpoint_factory("tiny"), num_blocks=8) as real:
        assert real.core.fingerprint not in (fp_a, fp_c)  # never shares blocks with a checkpoint
    with pytest.raises(Exception):  # noqa: B017 - without random_weights it needs the weights
        LLM(model, num_blocks=8)
