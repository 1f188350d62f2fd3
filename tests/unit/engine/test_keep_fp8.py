"""FP8 weights kept quantised (``EngineConfig.keep_quantized``; `engine.model.qlinear.keep_fp8_`
for random weights): which tensors become FP8, what the model computes with them, and the
cache identity of an engine serving them."""

from __future__ import annotations

import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.checkpoint.generate import write_config_dir
from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.kernels import kernels_on
from engine.model.attention import GroupedLinear
from engine.model.experts import Experts
from engine.model.packed_linear import PackedLinear
from engine.model.qlinear import QuantLinear, graph_safe, keep_fp8_
from engine.runner import ModelRunner, RunnerConfig


def _runner(fp8: bool) -> ModelRunner:
    mc = ModelConfig.from_dict(preset_config("tiny", num_hidden_layers=2))
    return ModelRunner.random(mc, RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False), seed=3, fp8=fp8)


def test_keep_fp8_quantises_what_an_fp8_checkpoint_ships_and_nothing_else() -> None:
    r = _runner(fp8=True)
    mods = dict(r.model.named_modules())
    for name, mod in mods.items():
        if isinstance(mod, Experts):
            assert mod.quantized == {"gate_up_proj", "down_proj"}
            assert mod.gate_up_proj_q.dtype == torch.float8_e4m3fn and mod.down_proj_q.dim() == 3
        if name.endswith(("q_a_proj", "q_b_proj", "o_b_proj", "shared_experts.down_proj")):
            assert isinstance(mod, QuantLinear), name
        if name.endswith("o_a_proj"):
            assert isinstance(mod, GroupedLinear) and mod.qweight is not None
        # BF16 in DeepSeek's FP8 checkpoints: the head, the compressors', the indexer's weights
        if name.endswith(("compressor.kv_proj", "indexer.gate_proj", "weights_proj")):
            assert type(mod) is nn.Linear, name
        if name == "lm_head":
            assert type(mod) is PackedLinear  # a plain linear's weight (packed for the CPU on use)
    # FP8 experts leave decode steps capturable only where the FP8 kernels run
    assert graph_safe(r.model) == kernels_on() and graph_safe(_runner(fp8=False).model)


def test_fp8_weights_compute_close_to_the_weights_they_round() -> None:
    """The same seed with and without FP8: logits within FP8's rounding (e4m3: 3 mantissa bits),
    far closer than another seed's."""
    ids = list(range(3, 40))
    batch = ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])
    full, quant = _runner(False), _runner(True)
    a, b = full.execute(batch).logits, quant.execute(batch).logits
    other = (
        ModelRunner.random(full.model_cfg, RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False), seed=4)
        .execute(batch)
        .logits
    )
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < 0.1 and rel < 0.2 * (a - other).norm() / a.norm()
    assert keep_fp8_(nn.Sequential(nn.Linear(4, 4, bias=True))) == 0  # biased linears stay


def test_an_fp8_random_engine_has_its_own_cache_identity(tmp_path) -> None:
    model = write_config_dir("tiny", tmp_path / "tiny")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prints = []
    for keep in (False, True):
        with LLM(
            model, random_weights=7, keep_quantized=keep, num_blocks=8, num_swa_slots=2, max_num_seqs=2
        ) as llm:
            out = llm.generate(prompt_token_ids=[[0, 5, 6, 7]], sampling_params=greedy)
            assert len(out[0].outputs[0].token_ids) == 4
            prints.append(llm.core.fingerprint)
    assert prints[0] != prints[1]  # FP8-rounded weights never share blocks with the originals
