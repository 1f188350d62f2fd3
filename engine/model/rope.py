"""Partial interleaved RoPE (GPT-J pairs) on the trailing `rope_dim` channels.

Sliding-only layers use plain RoPE (theta 10000); compressed layers, their compressors and
the indexer use YaRN with theta 160000 and the attention factor forced to 1.0 (so cos/sin are
not rescaled). Inverse rotation = the same call with ``inverse=True`` (cos, -sin).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from engine.config import RopeConfig
from engine.kernels import rope as rope_kernel


def inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """[rope_dim // 2] inverse frequencies, YaRN-corrected when ``cfg.factor`` is set."""
    dim = cfg.rope_dim
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1.0 / pos_freqs
    if cfg.factor is None:
        return extra
    inter = 1.0 / (cfg.factor * pos_freqs)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(cfg.original_max_position / (rot * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = corr_dim(cfg.beta_fast), corr_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor


class _CosSinCache:
    """The latest cos/sin tables, shared by every `Rotary` of one RoPE flavour: a forward pass
    asks each layer's rotary (queries, keys, the output's inverse, compressors, indexer) for
    the same positions, and the trig then ran ~6 times per layer. An entry is found only for
    the very positions tensor it was made from (held here, so its id cannot be reused) at the
    same version, so a hit returns exactly what a recomputation would. Tensors made under
    ``torch.inference_mode`` keep no version: for them this relies on positions never being
    changed in place, which no code in ``engine/`` does (a forward's positions are built per
    batch and only read)."""

    SIZE = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )

    def get(self, key: tuple[Any, ...], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] is not positions:
                return None
            self._items.move_to_end(key)
            return item[1], item[2]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def put(
        self, key: tuple[Any, ...], positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        with self._lock:
            self._items[key] = (positions, cos, sin)
            self._items.move_to_end(key)
            while len(self._items) > self.SIZE:
                self._items.popitem(last=False)


_COS_SIN = _CosSinCache()


def clear_cos_sin_cache() -> None:
    """Forget every table. A CUDA graph capture calls it first: a table found in the cache
    would be read as a constant by the graph instead of being recomputed at each replay."""
    _COS_SIN.clear()


class Rotary(nn.Module):
    """Applies interleaved RoPE at given absolute positions."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.rope_dim = cfg.rope_dim
        self.flavour = dataclasses.astuple(cfg)  # rotaries of one flavour share cos/sin tables
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rope_dim] (pairs repeated)."""
        version = -1 if positions.is_inference() else positions._version
        key = (self.flavour, id(positions), version, dtype, positions.device)
        found = _COS_SIN.get(key, positions)
        if found is not None:
            return found
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [N, rope_dim/2]
        cos = freqs.cos().to(dtype).repeat_interleave(2, dim=-1)
        sin = freqs.sin().to(dtype).repeat_interleave(2, dim=-1)
        _COS_SIN.put(key, positions, cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, ..., D] with positions [N]; rotates x[..., -rope_dim:], in place unless x
        requires grad (the caller's x is then the result)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if rope_kernel.usable(x, self.rope_dim):
            return rope_kernel.rope_(x, cos, sin, inverse)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.rope_dim,)
        cos, sin = cos.view(shape), sin.view(shape)
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        x1, x2 = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        out = (rope.float() * cos + rot.float() * sin).to(x.dtype)
        if x.requires_grad:  # training: autograd keeps ``rope`` for the backward pass
            return torch.cat([nope, out], dim=-1)
        # every caller hands over a tensor it made for this call: rotate its tail in place
        # rather than copy the untouched ``nope`` part (7/8 of a flash-shape query) with a cat
        x[..., -self.rope_dim :] = out
        return x
