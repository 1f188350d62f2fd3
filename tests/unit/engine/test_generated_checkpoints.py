"""`sluice gen-checkpoint` output (transformers key names, packed experts, MTP under ``mtp.0``)
loads into Sluice: sharded or not, bf16/fp32, FP8 / FP4."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.loader import checkpoint_files
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig


def _logits(path, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1))
    assert runner.unused_keys == [] or all(
        k.startswith("mtp.0.self_attn.compressor") for k in runner.unused_keys
    )
    return runner.execute(ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])).logits[0]


def _hf(path, ids: list[int]) -> torch.Tensor:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._experts_implementation = "eager"
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


def test_tiny_sharded_checkpoint_matches_transformers(checkpoint_factory) -> None:
    whole = checkpoint_factory("tiny")
    sharded = checkpoint_factory("tiny", shard_bytes=200_000)
    assert len(checkpoint_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").exists()
    ids = list(range(5, 105))
    want = _hf(whole, ids)
    for path in (whole, sharded):
        assert (_logits(path, ids) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("quant", ["fp8", "fp4"])
def test_quantised_generated_checkpoint_loads(checkpoint_factory, quant: str) -> None:
    plain = checkpoint_factory("tiny", hidden_size=128, moe_intermediate_size=64)
    q = checkpoint_factory("tiny", quant=quant, hidden_size=128, moe_intermediate_size=64)
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["expert_dtype"] == quant
    ids = list(range(7, 60))
    a, b = _logits(plain, ids), _logits(q, ids)
    assert torch.isfinite(b).all()
    # quantisation error is visible but bounded (same random model, e4m3 / e2m1 weights)
    diff = (a - b).abs().max().item()
    assert 1e-5 < diff < 0.5 * a.abs().max().item()
