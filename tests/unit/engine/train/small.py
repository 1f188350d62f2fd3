"""The shrunken model shape and training settings the `sluice train` stages' tests share."""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.checkpoint.presets import CSA, HCA, SLIDING
from engine.train.trainer import TrainSettings

# Every layer and MoE kind at test size; window 16 and CSA top-4 so 64-token contexts exercise both.
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    head_dim=32,
    q_lora_rank=32,
    o_lora_rank=16,
    moe_intermediate_size=32,
    sliding_window=16,
    index_topk=4,
    index_head_dim=16,
    compress_rates={CSA: 4, HCA: 16},
)
SETTINGS = TrainSettings(
    seq_len=64, batch=4, micro_batch=2, steps=4, warmup=1, eval_every=2, eval_windows=2, accept_prompts=4
)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
