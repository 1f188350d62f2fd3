"""mHC's Sinkhorn normalisation of the [n, n] mixing matrix of every token, in one launch.

The eager loop (`engine.model.hyper.sinkhorn_eager`) is 3 kernels per half-iteration: with
V4's 20 iterations that is ~114 launches per hyper-connection, two per layer, on a [T, 4, 4]
tensor: on a GPU a decode step is launch-bound, and this loop was about half of a layer's
kernels. The kernel runs one program per token over its n x n matrix held in registers, with
the same operations in the same order (column sums first, then row and column sums per
iteration, each divided by sum + eps).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import kernels_on, tracks_grad


@functools.cache
def _kernel():  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def sinkhorn_kernel(x_ptr, out_ptr, iters, eps, N: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, N)[:, None]
        cols = tl.arange(0, N)[None, :]
        offs = pid * N * N + rows * N + cols
        m = tl.load(x_ptr + offs)
        m = m / (tl.sum(m, axis=0)[None, :] + eps)
        for _ in range(iters - 1):
            m = m / (tl.sum(m, axis=1)[:, None] + eps)
            m = m / (tl.sum(m, axis=0)[None, :] + eps)
        tl.store(out_ptr + offs, m)

    return sinkhorn_kernel


def usable(comb: torch.Tensor) -> bool:
    """The kernel takes a CUDA fp32 [T, n, n] tensor with n a power of two (V4: n = 4)."""
    n = comb.shape[-1]
    return (
        comb.is_cuda and comb.dtype == torch.float32 and comb.dim() == 3 and comb.shape[1] == n
        and n > 0 and n & (n - 1) == 0 and kernels_on() and not tracks_grad(comb)
    )  # fmt: skip


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb`` [T, n, n] (softmax rows + eps) -> its Sinkhorn normalisation, as the eager loop."""
    x = comb.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _kernel()[(x.shape[0],)](x, out, iters, eps, N=x.shape[-1])
    return out
