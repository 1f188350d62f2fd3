"""Attention for training: transformers' eager DeepSeek-V4 attention, per chunk of queries.

Registered with transformers' ``AttentionInterface`` under ``WINDOWED_ATTENTION``; the
training model (``engine.train.model.TrainModel``) selects it by default.
"""

from __future__ import annotations

from typing import Any

import torch

WINDOWED_ATTENTION = "sluice_windowed"
_QUERY_CHUNK = 512


def windowed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager V4 attention, computed per chunk of queries over only the keys a chunk can
    see: its sliding window and the compressed entries. Same softmax (sinks included) over the same
    unmasked entries; the masked ones it skips weigh exactly 0 in eager too, so only the order of the
    float sums differs (tested against eager). Eager materialises [heads, S, S + T] scores per
    sequence; this holds [heads, chunk, chunk + window + T], which is what makes 4K-token training
    affordable. Returns the attention weights over the compressed entries alone ([B, H, S, T]),
    which is all the indexer distillation reads.
    """
    if attention_mask is None or sliding_window is None:
        raise ValueError("windowed attention needs the model's additive mask and its sliding window")
    b, h, s, d = query.shape
    n = key.shape[2]
    t = n - s  # compressed entries appended after the S window keys
    sinks = module.sinks.reshape(1, -1, 1, 1)
    outs, weights = [], []
    comp = torch.arange(s, n, device=query.device)
    for a in range(0, s, _QUERY_CHUNK):
        e = min(s, a + _QUERY_CHUNK)
        lo = max(0, a - sliding_window + 1)
        cols = torch.cat([torch.arange(lo, e, device=query.device), comp])
        k = key.index_select(2, cols)  # [B, 1, K, D]: one KV head, broadcast over H
        v = value.index_select(2, cols)
        scores = torch.matmul(query[:, :, a:e], k.transpose(2, 3)) * scaling
        scores = scores + attention_mask[:, :, a:e].index_select(-1, cols)
        logits = torch.cat([scores, sinks.expand(b, -1, e - a, -1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(value.dtype)
        outs.append(torch.matmul(probs, v))
        weights.append(probs[..., probs.shape[-1] - t :])
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), torch.cat(weights, dim=2)


def register_windowed_attention() -> None:
    """Make ``WINDOWED_ATTENTION`` a name transformers' attention dispatch knows (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(WINDOWED_ATTENTION, windowed_attention)
