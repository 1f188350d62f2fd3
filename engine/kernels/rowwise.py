"""Two memory-bound row operations of a prefill step, one launch and one pass each.

* `rms_unweighted`: the per-head query norm, ``x * rsqrt(mean(x^2) + eps)`` with the mean in
  fp32 and the scale rounded to x's dtype before the product (the reference's order,
  `engine.model.norms.rms_unweighted`). Eagerly it is five kernels over an fp32 copy of the
  queries (~2 ms for a 4,096-token flash-shape step on an H200).
* `combine`: each token's weighted sum of its k expert outputs, read in place from the
  grouped GEMM's expert-major rows through the inverse permutation, summed in fp32 in the
  order k = 0, 1, ... (`engine.model.moe.combine`'s order), rounded once. Eagerly: a scatter
  back to token order, an fp32 copy of every row, a product and a sum.

One program per row (and block of columns): per token, so batch-invariant.
"""

from __future__ import annotations

import torch

from engine.kernels import kernels_on

BLOCK_D = 1024


def _build():  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def rms_kernel(x_ptr, o_ptr, D, eps, s_x, s_o, BD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        x = tl.load(x_ptr + r * s_x + d, mask=m, other=0.0)
        xf = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps).to(x.dtype).to(tl.float32)
        tl.store(o_ptr + r * s_o + d, (xf * scale).to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def combine_kernel(y_ptr, inv_ptr, w_ptr, o_ptr, D, s_y, s_w, s_o, K: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        m = d < D
        acc = tl.zeros((BD,), tl.float32)
        for k in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + k).to(tl.int64)
            w = tl.load(w_ptr + t * s_w + k).to(tl.float32)
            acc += tl.load(y_ptr + row * s_y + d, mask=m, other=0.0).to(tl.float32) * w
        tl.store(o_ptr + t * s_o + d, acc.to(o_ptr.dtype.element_ty), mask=m)

    return {"rms": rms_kernel, "combine": combine_kernel}


_KERNELS: dict | None = None


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build()
    return _KERNELS


def usable(x: torch.Tensor) -> bool:
    return x.is_cuda and kernels_on()


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (D <= 8192) -> the unweighted RMS norm of each row, in x's dtype."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        bd = max(16, 1 << (d - 1).bit_length())
        _kernels()["rms"][(rows.shape[0],)](
            rows, out, d, eps, rows.stride(0), out.stride(0), BD=bd, num_warps=4
        )
    return out.view(x.shape)


def combine(
    y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Token t's output: sum over k of weights[t, k] * y[inverse[t * K + k]] (fp32, then
    ``dtype``); y [N*K, D] in any row order, inverse [N*K] its row of each (token, k)."""
    n, k = weights.shape
    d = y.shape[-1]
    out = torch.empty(n, d, dtype=dtype, device=y.device)
    if n:
        y, weights, inverse = y.contiguous(), weights.contiguous(), inverse.contiguous()
        _kernels()["combine"][(n, -(-d // BLOCK_D))](
            y, inverse, weights, out, d, y.stride(0), weights.stride(0), out.stride(0), K=k, BD=BLOCK_D
        )
    return out
