"""Cache bytes per token per layer type: the formulas, the allocated tensors, and V4.1-Flash's shape."""

from __future__ import annotations

import pytest
import torch

from engine.cache.pool import CompressedPool
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.config import BLOCK_TOKENS, CSA, HCA, SLIDING, ModelConfig
from tests.unit.engine.refmodel import BASE

#: DeepSeek's released config.json spelling, V4-Flash / V4.1-Flash shape (43 layers + 1 MTP)
FLASH = dict(
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    qk_rope_head_dim=64,
    num_experts_per_tok=6,
    n_routed_experts=256,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    num_hash_layers=3,
    o_groups=8,
    o_lora_rank=1024,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    max_position_embeddings=1048576,
)


def test_flash_shape_parses_from_deepseek_spelling() -> None:
    cfg = ModelConfig.from_dict(FLASH)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.layer_types.count(SLIDING) == 2 and cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert cfg.rope_dim == 64 and cfg.compress_rope.factor == 16 and cfg.main_rope.factor is None


def test_bytes_per_token_per_layer_type_bf16() -> None:
    spec = CacheSpec.from_model(ModelConfig.from_dict(FLASH), elem_bytes=2, state_bytes=2)
    assert spec.window_bytes() == 128 * 1024  # 1024 B/token, bounded to 128 tokens
    assert spec.paged_bytes_per_token(CSA) == 1024 / 4 + 256 / 4  # CSA row + indexer row
    assert spec.paged_bytes_per_token(HCA) == 1024 / 128
    assert spec.paged_bytes_per_token(SLIDING) == 0
    # 21 CSA * 320 B + 20 HCA * 8 B per token of context, for a whole 256-token block:
    assert spec.paged_bytes_per_block() == (21 * 320 + 20 * 8) * BLOCK_TOKENS
    csa_state = 2 * 4 * 4 * 512 * 2 + 2 * 4 * 4 * 128 * 2  # ring 2m x (kv+gate of Ca|Cb), + indexer
    hca_state = 128 * 2 * 512 * 2
    assert spec.state_bytes_of(CSA) == csa_state and spec.state_bytes_of(HCA) == hca_state
    # the SWA slot of one sequence: 44 windows (43 layers + MTP) + compressor state
    assert spec.slot_bytes() == 44 * 128 * 1024 + 21 * csa_state + 20 * hca_state == 11_870_208


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocated_tensors_match_the_formula(dtype: torch.dtype) -> None:
    d = {**BASE, "model_type": "deepseek_v4"}
    cfg = ModelConfig.from_dict(d)
    spec = CacheSpec.from_model(cfg, elem_bytes=dtype.itemsize, state_bytes=dtype.itemsize)
    swa = SWASlots(spec, 3, dtype, "cpu")
    assert swa.nbytes_per_slot() == spec.slot_bytes()
    pool = CompressedPool(spec, 5, dtype, "cpu")
    total = sum(t.numel() * t.element_size() for t in [*pool.rows.values(), *pool.index_rows.values()])
    assert total == 5 * spec.paged_bytes_per_block()


def test_config_validation_is_actionable() -> None:
    with pytest.raises(ValueError, match="index_head_dim"):
        ModelConfig.from_dict({**FLASH, "index_head_dim": 32})
    with pytest.raises(ValueError, match="o_groups"):
        ModelConfig.from_dict({**FLASH, "o_groups": 7})
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_dict({k: v for k, v in FLASH.items() if k != "compress_ratios"})
