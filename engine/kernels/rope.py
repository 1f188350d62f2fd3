"""Interleaved RoPE on the trailing ``rope_dim`` channels of each head, in place, one launch.

Eagerly `engine.model.rope.Rotary` takes the even and odd channels, stacks ``(-x2, x1)``,
makes fp32 copies of both, multiplies by cos and sin, adds and rounds back: eight passes
over the rotated part (~2 ms a 4,096-token flash-shape step of two layers on an H200, for
the queries and the output's inverse rotation). The kernel reads each pair once and writes
it back: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32 from the same cos/sin tables (in the
activations' dtype), rounded once, as the eager code rounds. One program per (token, block
of heads): per token, so batch-invariant.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import kernels_on, tracks_grad

BLOCK_H = 16


@functools.cache
def _kernels() -> dict:  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        x_ptr, cos_ptr, sin_ptr, M, D, s_n, s_m, s_c, sign,
        R: tl.constexpr, BH: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        i = tl.arange(0, R // 2)
        hm = h < M
        c = tl.load(cos_ptr + n * s_c + 2 * i).to(tl.float32)[None, :]
        s = (tl.load(sin_ptr + n * s_c + 2 * i).to(tl.float32) * sign)[None, :]
        ptrs = x_ptr + n * s_n + h[:, None].to(tl.int64) * s_m + (D - R) + tl.arange(0, R)[None, :]
        x = tl.load(ptrs, mask=hm[:, None], other=0.0)  # contiguous rows: whole cache lines
        x1, x2 = tl.split(tl.reshape(x.to(tl.float32), (BH, R // 2, 2)))  # the even and odd channels
        out = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (BH, R))
        tl.store(ptrs, out.to(x.dtype), mask=hm[:, None])

    return {"rope": rope_kernel}


def usable(x: torch.Tensor, rope_dim: int) -> bool:
    """CUDA x [N, D] or [N, M, D] with unit channel stride, an even power-of-two ``rope_dim``,
    with Triton, outside autograd."""
    return (
        x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1 and rope_dim >= 2
        and rope_dim & (rope_dim - 1) == 0 and kernels_on() and not tracks_grad(x)
    )  # fmt: skip


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x's trailing ``cos.shape[-1]`` channels in place; cos, sin [N, rope_dim] (pairs
    repeated, `Rotary.cos_sin`); ``inverse``: by -sin. Returns x."""
    n, d, r = x.shape[0], x.shape[-1], cos.shape[-1]
    m = x.shape[1] if x.dim() == 3 else 1
    s_m = x.stride(1) if x.dim() == 3 else 0
    cos, sin = cos.contiguous(), sin.contiguous()
    if n and m:
        _kernels()["rope"][(n, -(-m // BLOCK_H))](
            x, cos, sin, m, d, x.stride(0), s_m, cos.stride(0), -1.0 if inverse else 1.0, R=r, BH=BLOCK_H,
        )  # fmt: skip
    return x
