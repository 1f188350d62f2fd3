"""The compressors' softmax-gated pooling (`engine.model.compressor.Compressor.step`) in one
kernel: each closing window's rows and gates read where the step's projections lie, the
position bias added, the softmax over the window's rows in fp32, the weights rounded to the
rows' dtype, each product rounded as the eager product is, and the sum in fp32 rounded once.
Eagerly the same is ~12 operations a call (a zeroed and a -inf-filled window tensor, two to
four copies into them, two bias additions, the softmax, a cast, a product and a sum), three
calls a step for two flash-shape layers.

With overlap (CSA, rate m), window w pools 2m rows: the previous window's m rows in the first
half of the channels (Ca; none for window 0) and its own m rows in the second half (Cb);
without (HCA), its own m rows. One program per (window, block of channels): a window's
result does not depend on the others in its step, so it is the same in any chunking. The
sums over a window's rows run in the kernel's reduction order, not torch's: within a bf16
ulp of the eager pooling, which the batch-invariant mode keeps (its decode must equal its
prefill bit for bit).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import batch_invariant, kernels_on, tracks_grad

#: a program's tile (window rows x channels) holds at most this many elements
POOL_BLOCK_ELEMENTS = 4096
#: On (CUDA, outside the batch-invariant mode) since its GPU run on 2026-12-04:
#: `tests/gpu/test_kernels.py::test_the_pooling_kernel_matches_the_eager_pooling` found it
#: bitwise equal to `Compressor._pool` in 3 of 4 cases at flash widths (0.9997 of the
#: elements in the fourth, all within rtol 1.6e-2: a bf16 ulp), and the GPU suite passed with it
#: on; flash-shape prefill steps ~1.5 % faster at 4,096 tokens and ~0.8 % at 16,384 (`sluice
#: bench engine --pooling-kernel ab`, docs/benchmarks.md). Off: the eager `Compressor._pool`. Also checked in Triton's
#: interpreter (`tests/unit/engine/test_pooling_interpreted.py`, where Triton is installed).
FUSED_POOLING = True


@functools.cache
def _kernel():  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def pool_kernel(
        kv_ptr, gate_ptr, bias_ptr, out_ptr, first_row, w0, D, s_kv, s_gate, s_bias, s_out,
        M: tl.constexpr, OVERLAP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0)
        c = tl.program_id(1) * BD + tl.arange(0, BD)
        i = tl.arange(0, BM)
        if OVERLAP:
            # rows i < M: the previous window's (channels [0, D)); rows M <= i < 2M: this
            # window's own (channels [D, 2D)); both start at first_row + (j - 1) * M + i
            own = i >= M
            src = first_row + (j - 1) * M + i
            col = c[None, :] + tl.where(own, D, 0)[:, None]
            brow = tl.where(own, i - M, i)
            later = (i * 0 + w0 + j) > 0  # a vector: Triton's interpreter refuses a scalar here
            rows = (i < 2 * M) & (own | later)
        else:
            src = first_row + j * M + i
            col = c[None, :] + 0 * i[:, None]
            brow = i
            rows = i < M
        m = rows[:, None] & (c < D)[None, :]
        src = src.to(tl.int64)[:, None]
        kv = tl.load(kv_ptr + src * s_kv + col, mask=m, other=0.0)
        g = tl.load(gate_ptr + src * s_gate + col, mask=m, other=0.0).to(tl.float32)
        g += tl.load(bias_ptr + brow[:, None] * s_bias + col, mask=m, other=0.0)
        g = tl.where(m, g, float("-inf"))
        e = tl.where(m, tl.exp(g - tl.max(g, axis=0)[None, :]), 0.0)
        p = (e / tl.sum(e, axis=0)[None, :]).to(kv.dtype)
        pooled = tl.sum((kv * p).to(kv.dtype).to(tl.float32), axis=0)
        tl.store(out_ptr + j * s_out + c, pooled.to(out_ptr.dtype.element_ty), mask=c < D)

    return pool_kernel


def usable(kv: torch.Tensor) -> bool:
    """CUDA rows with the kernels on, outside autograd and the batch-invariant mode (and
    `FUSED_POOLING`)."""
    return (
        FUSED_POOLING
        and kv.is_cuda
        and kernels_on()
        and not tracks_grad(kv)
        and not batch_invariant.enabled()
    )


def pool(
    rows: torch.Tensor,  # [L, C] the step's rows from position ``lo`` (the ring's, then the new)
    gates: torch.Tensor,  # [L, C]
    bias: torch.Tensor,  # [m, C] fp32 position bias
    first_row: int,  # row of window ``w0``'s first position
    w0: int,  # the first closing window's index
    windows: int,
    rate: int,
    dim: int,
    overlap: bool,
) -> torch.Tensor:
    """The pooled rows [windows, dim] of windows ``w0 .. w0 + windows - 1``, in ``rows``' dtype:
    with ``overlap`` (C = 2 dim) window w pools the previous window's rows in channels
    [0, dim) (none for window 0) and its own in [dim, 2 dim); without (C = dim) its own."""
    out = torch.empty(windows, dim, dtype=rows.dtype, device=rows.device)
    if windows == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    gates = gates if gates.stride(-1) == 1 else gates.contiguous()
    bias = bias.float().contiguous()
    bm = 1 << ((2 * rate if overlap else rate) - 1).bit_length()
    bd = max(16, min(1 << (dim - 1).bit_length(), POOL_BLOCK_ELEMENTS // bm))
    _kernel()[(windows, -(-dim // bd))](
        rows, gates, bias, out, first_row, w0, dim, rows.stride(0), gates.stride(0), bias.stride(0),
        out.stride(0), M=rate, OVERLAP=overlap, BM=bm, BD=bd, num_warps=4,
    )  # fmt: skip
    return out
