"""`ModelRunner`: owns the model and its caches; ``execute(ForwardBatch) -> RunnerOutput``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache.pool import CompressedPool
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.checkpoint.loader import load_weights
from engine.config import ModelConfig
from engine.distributed.ep import select_dispatch
from engine.forward_batch import ForwardBatch
from engine.model.model import DeepseekV4
from engine.model.moe import ExpertPlacement

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    num_blocks: int = 64  # physical compressed-state blocks (256 positions each)
    num_slots: int = 8  # SWA slots (max concurrent sequences)
    dtype: str = "float32"
    device: str = "cpu"
    with_mtp: bool = True
    keep_quantized: bool = False  # FP8/FP4 weights stay quantised on the device, dequantised per use
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} unknown; known: {sorted(_DTYPES)}")
        if self.num_blocks < 1 or self.num_slots < 1:
            raise ValueError("num_blocks and num_slots must be >= 1")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} must be in [0, ep_size={self.ep_size})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_sampled, vocab] fp32, sequence order of those with sample=True
    hidden: torch.Tensor  # [T, hc, D] final hc streams (input of the MTP head)


#: Parameters transformers keeps in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict).
FP32_PARTS = (
    "attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
    "kv_norm", "input_layernorm", "post_attention_layernorm", "norm.", "enorm", "hnorm",
)  # fmt: skip


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter to ``dtype`` except those the reference keeps in fp32."""
    for name, p in model.named_parameters():
        if not any(part in name for part in FP32_PARTS):
            p.data = p.data.to(dtype)


class ModelRunner:
    def __init__(self, model_dir: str | Path, cfg: RunnerConfig, ep_group: object | None = None) -> None:
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_dir(model_dir)
        placement = ExpertPlacement.identity(self.model_cfg.n_routed_experts, cfg.ep_size)
        model = DeepseekV4(self.model_cfg, placement, cfg.ep_rank, with_mtp=cfg.with_mtp)
        cast_parameters(model, cfg.torch_dtype)
        self.unused_keys = load_weights(model, model_dir, keep_quantized=cfg.keep_quantized)
        self.model = model.to(device=cfg.device).eval()
        dispatch = select_dispatch(ep_group, cfg.ep_size, torch.device(cfg.device))
        for moe in self.model.moe_layers():
            moe.dispatch = dispatch
        self.spec = CacheSpec.from_model(
            self.model_cfg, elem_bytes=cfg.torch_dtype.itemsize, state_bytes=cfg.torch_dtype.itemsize
        )
        self.pool = CompressedPool(self.spec, cfg.num_blocks, cfg.torch_dtype, cfg.device)
        self.swa = SWASlots(self.spec, cfg.num_slots, cfg.torch_dtype, cfg.device)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> RunnerOutput:
        logits, hidden = self.model(batch, self.pool, self.swa)
        return RunnerOutput(logits, hidden)

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, depth: int = 0):
        """MTP draft logits for the token after ``next_ids`` (see `DeepseekV4.forward_mtp`)."""
        return self.model.forward_mtp(hidden, next_ids, batch, self.pool, self.swa, depth)

    def copy_slot(self, src: int, dst: int) -> None:
        self.swa.copy_slot(src, dst)

    def expert_load(self) -> torch.Tensor:
        return self.model.expert_load()
