"""DeepSeek-V4 causal LM over a flattened `ForwardBatch`; module names follow transformers' keys."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.hyper import HyperHead
from engine.model.layer import DecoderLayer
from engine.model.moe import ExpertPlacement, MoE
from engine.model.mtp import MTPLayer
from engine.model.norms import RMSNorm
from engine.model.packed_linear import PackedLinear


class V4Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, placement: ExpertPlacement | None, ep_rank: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, m == "hash_moe", placement, ep_rank)
            for t, m in zip(cfg.layer_types, cfg.mlp_layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4(nn.Module):
    """Main model plus MTP draft layer(s). Weights load from transformers-named safetensors keys."""

    def __init__(
        self,
        cfg: ModelConfig,
        placement: ExpertPlacement | None = None,
        ep_rank: int = 0,
        with_mtp: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = V4Backbone(cfg, placement, ep_rank)
        # on the CPU through oneDNN with its weight packed once (docs/engine.md, "The output head on the CPU")
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg, placement, ep_rank) for _ in range(n_mtp))

    def moe_layers(self) -> list[MoE]:
        layers = [*self.model.layers, *self.mtp]
        return [cast(DecoderLayer, layer).mlp for layer in layers]

    def expert_load(self) -> torch.Tensor:
        """[num_moe_layers, n_routed_experts] tokens routed to each logical expert in the last step."""
        return torch.stack([m.last_load for m in self.moe_layers()])

    def forward(
        self, batch: ForwardBatch, pool: CompressedPool, swa: SWASlots
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [rows, vocab] fp32 at ``batch.logit_indices``, final hc streams [T, hc, D] for the MTP head)."""
        h, streams = self.final_hidden(batch, pool, swa)
        return self.logits(h), streams

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden rows [rows, D] -> logits [rows, vocab] fp32."""
        return self.lm_head(h).float()

    def final_hidden(
        self, batch: ForwardBatch, pool: CompressedPool, swa: SWASlots
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward up to the ``lm_head``: (normed hidden rows [rows, D] at
        ``batch.logit_indices``, final hc streams [T, hc, D])."""
        batch.forget_memo()
        ids = batch.input_ids
        emb = self.model.embed_tokens(ids)  # [T, D]
        for at, rows in batch.embeds:  # image positions: the vision encoder's rows
            emb[at : at + rows.shape[0]] = rows.to(device=emb.device, dtype=emb.dtype)
        streams = emb.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        for i, layer in enumerate(self.model.layers):
            streams = layer(streams, batch, pool, swa, i, ids)
        if batch.padded is not None and batch.padded.query > 1:
            return self.model.norm(self.model.hc_head(streams)), streams  # every token (graphs)
        rows = batch.logit_indices
        return self.model.norm(self.model.hc_head(streams[rows])), streams

    def forward_mtp(
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        batch: ForwardBatch,
        pool: CompressedPool,
        swa: SWASlots,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft head: streams [T, hc, D] of the main model at each position, next_ids [T] the token
        after each position -> (logits [num_sampled, vocab] for the token after next, new streams)."""
        if depth >= len(self.mtp):
            raise ValueError(f"MTP depth {depth} requested but {len(self.mtp)} MTP layer(s) are loaded")
        layer = cast(MTPLayer, self.mtp[depth])
        batch.forget_memo()
        out = layer(
            streams,
            self.model.embed_tokens(next_ids),
            batch,
            pool,
            swa,
            self.cfg.num_hidden_layers + depth,
            next_ids,
        )
        rows = batch.sample_indices
        return self.logits(layer.norm(layer.hc_head(out[rows]))), out
