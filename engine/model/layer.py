"""One V4 decoder layer: mHC around attention and around the MoE."""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.attention import Attention
from engine.model.hyper import HyperConnection, hc_merge
from engine.model.moe import ExpertPlacement, MoE
from engine.model.norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_type: str,
        hashed: bool,
        placement: ExpertPlacement | None = None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_type)
        self.mlp = MoE(cfg, hashed, placement, ep_rank)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        pool: CompressedPool,
        swa: SWASlots,
        cache_layer: int,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """streams [T, hc, D] -> [T, hc, D]."""
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), batch, pool, swa, cache_layer, batch.cached_until)
        streams = hc_merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        real = None if batch.padded is None else batch.padded.real
        out = self.mlp(self.post_attention_layernorm(x), input_ids, real)
        return hc_merge(streams, out, post, comb)
