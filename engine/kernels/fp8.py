"""FP8 block-scaled weights (DeepSeek's e4m3 with one scale per 128 x 128 block) multiplied
without a bf16 copy of the weight.

A checkpoint's FP8 linears and experts kept quantised on the device
(`RunnerConfig.keep_quantized`) were dequantised at every use: an fp32 copy of the whole
weight, scaled, rounded to bf16, then the matmul. Here each tile of the weight is loaded as
FP8, scaled by its block's scale and rounded to bf16 in registers, exactly the values the
dequantised copy holds, and multiplied by the bf16 activations with fp32 accumulation (W8A16):
the weight's bytes read are halved, the activations are never quantised, and the result
differs from dequantise-then-matmul only in the order of the fp32 sums.

`grouped_matmul` takes rows grouped by expert (the routed experts; tiles never mix experts,
`engine.kernels.batch_invariant.tile_map`) and runs the batch-invariant grouped GEMM's kernel
with its ``SCALED`` step; `linear` is the same kernel with one group. The
tiles are fixed (never chosen from the number of rows), so a row's result is the same in any
batch.
"""

from __future__ import annotations

import torch

from engine.kernels import kernels_on, tracks_grad

#: DeepSeek's FP8 scale block (rows and columns of the weight)
BLOCK = 128
#: rows, output columns and reduced width per tile: BN divides the scale block, BK is one
BM, BN, BK = 64, 64, 128
NUM_WARPS, NUM_STAGES = 4, 3


def usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    """CUDA bf16 activations times an FP8 e4m3 weight, with Triton, outside autograd."""
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn
        and kernels_on() and not tracks_grad(x)
    )  # fmt: skip


def grouped_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_end: torch.Tensor
) -> torch.Tensor:
    """Rows x [R, K] grouped by expert (``row_end`` [E], int32, each group's end), FP8 weights
    q [E, N, K] with block scales [E, ceil(N/128), ceil(K/128)] -> [R, N] = x @ dequant(q[e]).T."""
    from engine.checkpoint.quant import scales_fp32
    from engine.kernels.batch_invariant import grouped_kernel, tile_map

    r, k = x.shape
    e, n, _ = q.shape
    s = scales_fp32(scale)
    if s.shape != (e, -(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"scales {tuple(scale.shape)} do not cover {tuple(q.shape)} in {BLOCK}-blocks")
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    expert, row = tile_map(row_end, r, BM)
    grouped_kernel()[(expert.shape[0], -(-n // BN))](
        x, q, s, out, expert, row, row_end, n, k, e,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), q.stride(2), s.stride(0), s.stride(1), s.stride(2),
        out.stride(0), out.stride(1), BM=BM, BN=BN, BK=BK, SCALED=True, BLOCK=BLOCK,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(q [N, K]).T with block scales [ceil(N/128), ceil(K/128)] -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    end = torch.full((1,), rows.shape[0], dtype=torch.int32, device=x.device)
    out = grouped_matmul(rows, q.unsqueeze(0), scale.unsqueeze(0), end)
    return out.view(*x.shape[:-1], q.shape[0])
