"""MXFP8 (OCP Microscaling, E4M3 elements): a compact stored form for sliding-window state.

Each run of 32 consecutive values along the last dimension shares one scale, a power of
two stored as one biased exponent byte (E8M0: ``2 ** (byte - 127)``); each value is one
float8 E4M3 byte. 32 values take 33 bytes, so a 512-wide head takes 528 bytes per token per
layer, DeepSeek's host-slot figure for V4.1-Flash.

The scale is the smallest power of two that brings the block's largest magnitude within
E4M3's range (448), so it lands in (224, 448]. (The OCP reference rule,
``2 ** (floor(log2(amax)) - 8)``, puts it in [256, 512) and clamps everything above 448:
up to 12.5% error on the block's largest values. One more bit of headroom costs only
subnormal range.) Round trip: a value in E4M3's normal range keeps 3 mantissa bits
(relative error <= 2**-4); smaller ones are subnormal (absolute error <= 2**-10 of the
scale). Zeros, and blocks of zeros, are exact. Non-finite values are refused: the stored
state must be finite.
"""

from __future__ import annotations

import torch

BLOCK = 32
_E4M3_MAX = 448.0  # 1.75 * 2**8, E4M3's largest finite value
_BIAS = 127


def encoded_bytes(numel: int) -> int:
    """Bytes of ``numel`` values (a multiple of 32) in MXFP8: one byte each, one per 32."""
    if numel % BLOCK:
        raise ValueError(f"MXFP8 needs a multiple of {BLOCK} values, got {numel}")
    return numel + numel // BLOCK


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values as uint8, same shape; E8M0 scales as uint8, [..., n / 32]) of ``x``,
    whose last dimension is a multiple of 32."""
    if x.shape[-1] % BLOCK:
        raise ValueError(
            f"MXFP8 blocks run along the last dimension: {x.shape[-1]} is not a multiple of {BLOCK}"
        )
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise ValueError("MXFP8: the tensor holds non-finite values")
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # the smallest k with amax <= 448 * 2**k, from the float's exponent field (exact)
    mant, exp = torch.frexp(amax / _E4M3_MAX)  # = mant * 2**exp, mant in [0.5, 1)
    shared = exp.to(torch.int32) - (mant == 0.5).to(torch.int32)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -_BIAS)).clamp(-_BIAS, _BIAS)
    shared = shared + (amax > _E4M3_MAX * torch.ldexp(torch.ones_like(amax), shared)).to(torch.int32)
    scaled = blocks / torch.ldexp(torch.ones_like(amax), shared)[..., None]
    values = scaled.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return values.reshape(x.shape), (shared + _BIAS).to(torch.uint8)


def decode(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``encode`` stored, in ``dtype``."""
    n = values.shape[-1]
    v = values.view(torch.float8_e4m3fn).float().reshape(*values.shape[:-1], n // BLOCK, BLOCK)
    scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - _BIAS)
    return (v * scale[..., None]).reshape(values.shape).to(dtype)
