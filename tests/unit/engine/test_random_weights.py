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


def test_random_weights_are_built_in_the_serving_dtype_and_equal_a_cast_fp32_build() -> None:
    """The model is built under its dtype (`engine.runner.default_dtype`): no fp32 copy of the
    weights exists on the device even for a moment (at flash-shape widths 26 GB a layer, which
    put three layers past an 80 GB card), and the weights equal the fp32 build cast after."""
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.checkpoint.random_init import randomize_
    from engine.config import ModelConfig
    from engine.runner import FP32_PARTS, ModelRunner, RunnerConfig

    mc = ModelConfig.from_dict(preset_config("tiny", num_hidden_layers=2))
    cfg = RunnerConfig(num_blocks=8, num_slots=2, dtype="bfloat16")
    created: list[torch.dtype] = []
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, p: created.append(p.dtype) if p is not None and p.numel() > 1024 else None
    )
    try:
        runner = ModelRunner.random(mc, cfg, seed=5)
    finally:
        hook.remove()
    assert torch.get_default_dtype() == torch.float32  # restored
    assert created and set(created) == {torch.bfloat16}, created  # the large ones: experts, projections

    reference = ModelRunner._build(mc, cfg, (None,), torch.device("cpu"))  # fp32, then cast
    randomize_(reference, 5)
    ours = dict(runner.model.named_parameters())
    for name, p in reference.named_parameters():
        keep = any(part in name for part in FP32_PARTS)
        assert ours[name].dtype == (torch.float32 if keep else torch.bfloat16), name
        assert ours[name].dtype == p.dtype and torch.equal(ours[name], p), name
    for name, b in reference.named_buffers():
        assert torch.equal(dict(runner.model.named_buffers())[name], b), name
