"""MTP draft layer: a decoder layer with window-only attention fed by
``h_proj(hnorm(main streams)) + e_proj(enorm(embedding of the next token))`` per stream,
with its own hc head and final norm; logits come from the shared ``lm_head``.
Its sliding window lives in the sequence's SWA slot as cache layer ``num_hidden_layers + depth``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.config import SLIDING, ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.hyper import HyperHead
from engine.model.layer import DecoderLayer
from engine.model.moe import ExpertPlacement
from engine.model.norms import RMSNorm


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(cfg, SLIDING, False, placement, ep_rank)
        d = cfg.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def forward(  # type: ignore[override]
        self,
        streams: torch.Tensor,
        next_emb: torch.Tensor,
        batch: ForwardBatch,
        pool: CompressedPool,
        swa: SWASlots,
        cache_layer: int,
        next_ids: torch.Tensor,
    ) -> torch.Tensor:
        """streams [T, hc, D], next_emb [T, D] -> [T, hc, D]."""
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_emb)).unsqueeze(1)
        return super().forward(x, batch, pool, swa, cache_layer, next_ids)
