"""FP8 block-scaled weights (DeepSeek's e4m3 with one scale per 128 x 128 block) multiplied
without a bf16 copy of the weight, in one of two ways (`set_compute`, `RunnerConfig.fp8_compute`):

* ``w8a16`` (the default): each tile of the weight is loaded as FP8, scaled by its block's
  scale and rounded to bf16 in registers, exactly the values a dequantised copy holds, and
  multiplied by the bf16 activations with fp32 accumulation. The weight's bytes read are
  halved, the activations are never quantised, and the result differs from
  dequantise-then-matmul only in the order of the fp32 sums.
* ``w8a8`` (DeepSeek's inference recipe): the activations are quantised too, per row and
  128-column block, to e4m3 with a power-of-two (ue8m0) scale (`quantize_rows`), and the
  products run on the FP8 tensor cores; each 128-wide slice of the reduction is scaled by
  its activation and weight scales and added in fp32 (`w8a8_grouped_matmul`; a dense product
  large enough, outside the batch-invariant mode, goes to torch's block-scaled GEMM instead:
  `torch_block_pays`). It computes
  ``dequant(x_q) @ dequant(w).T``: the activations carry e4m3's rounding (3 mantissa bits).
  Where no kernel runs (the CPU, kernels off) the same values are multiplied by the eager
  code (`fake_quantize_rows`), so both paths compute the same function.

`grouped_matmul` takes rows grouped by expert (the routed experts; tiles never mix experts,
`engine.kernels.grouped.tile_map`); `linear` is the same with one group. Our kernels'
tiles are fixed (never chosen from the number of rows), so a row's result is the same in any
batch, in both modes; torch's GEMM (chosen by the shape) is never used in the batch-invariant
mode.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from engine.kernels import kernels_on, tracks_grad

if TYPE_CHECKING:
    from engine.kernels.grouped import TileMaps

#: DeepSeek's FP8 scale block (rows and columns of the weight; columns of an activation row)
BLOCK = 128
#: W8A16: rows, output columns and reduced width per tile: BN divides the scale block, BK is one
BM, BN, BK = 64, 64, 128
NUM_WARPS, NUM_STAGES = 4, 3
#: W8A8: rows and output columns per tile (BK is BLOCK: one scale per row or column and step)
A8_BM, A8_BN, A8_WARPS, A8_STAGES = 64, 128, 4, 4
#: W8A8 grouped products whose experts average a whole row tile or more (prefill): wider
#: tiles, each weight tile read by fewer programs (3-5 % faster on the H200 at 96 rows per
#: expert; 3-45 % slower for decode's few rows and for dense products: `sluice bench fp8 --sweep`)
A8_WIDE_BN, A8_WIDE_WARPS = 256, 8
#: e4m3's largest finite value, and the smallest block maximum a scale is taken from (a block
#: of zeros gets this scale, as in DeepSeek's activation quantiser)
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4

COMPUTES = ("w8a16", "w8a8")
_COMPUTE = ["w8a16"]


def set_compute(mode: str) -> None:
    """Process-wide: how FP8 weights multiply (``w8a16`` or ``w8a8``, module docstring)."""
    if mode not in COMPUTES:
        raise ValueError(f"fp8 compute must be one of {COMPUTES}, not {mode!r}")
    _COMPUTE[0] = mode


def compute() -> str:
    return _COMPUTE[0]


def quantizes_activations(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether x times the weight ``q`` quantises x: ``w8a8``, an FP8 weight, and rows of whole
    128-column blocks (every width of DeepSeek's models; a narrower test model's products stay
    ``w8a16``, on every path)."""
    return _COMPUTE[0] == "w8a8" and q.dtype == torch.float8_e4m3fn and x.shape[-1] % BLOCK == 0


def usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    """CUDA bf16 activations times an FP8 e4m3 weight, with Triton, outside autograd."""
    return (
        x.is_cuda and x.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn
        and kernels_on() and not tracks_grad(x)
    )  # fmt: skip


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= v (positive normal fp32), from the bits: exact everywhere."""
    bits = v.contiguous().view(torch.int32)
    up = ((bits & 0x7FFFFF) != 0).to(torch.int32) << 23
    return ((bits & 0x7F800000) + up).view(torch.float32)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 128) -> (e4m3 [R, K], fp32 scales [R, K / 128]): each row's
    128-column block divided by the power of two at or above max(|block|, 1e-4) / 448, then
    rounded to nearest e4m3. Division by a power of two is exact, so the only rounding is
    e4m3's, and no value can exceed 448. Any device; `quantize_rows` is its kernel."""
    r, k = x.shape
    if k % BLOCK:
        raise ValueError(f"rows of {k} columns are not whole {BLOCK}-column blocks")
    blocks = x.float().reshape(r, k // BLOCK, BLOCK)
    scale = _pow2_ceil(blocks.abs().amax(-1).clamp(min=AMAX_FLOOR) / E4M3_MAX)
    q = (blocks * scale.reciprocal()[..., None]).to(torch.float8_e4m3fn)
    return q.reshape(r, k), scale


def eager_input(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x as the eager product with the weight ``q`` takes it: fake-quantised where
    `quantizes_activations`, else as is (the eager paths of every FP8 module)."""
    return fake_quantize_rows(x) if quantizes_activations(x, q) else x


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """The values ``w8a8`` multiplies, in x's dtype: dequant(quantize_rows(x)) (exact in bf16:
    e4m3's 3 mantissa bits times a power of two)."""
    lead, k = x.shape[:-1], x.shape[-1]
    q, s = quantize_rows_reference(x.reshape(-1, k))
    deq = q.float().reshape(-1, k // BLOCK, BLOCK) * s[..., None]
    return deq.reshape(*lead, k).to(x.dtype)


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(x_ptr, q_ptr, s_ptr, R, s_xm, s_qm, s_sm, BR: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        kb = tl.program_id(1)
        cols = kb * BLOCK + tl.arange(0, BLOCK)
        live = rows < R
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * s_xm + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0
        bits = v.to(tl.int32, bitcast=True)
        up = ((bits & 0x7FFFFF) != 0).to(tl.int32) << 23
        s_bits = (bits & 0x7F800000) + up
        inv = ((254 << 23) - s_bits).to(tl.float32, bitcast=True)  # 1 / s, exact
        q = (x * inv[:, None]).to(tl.float8e4nv)
        tl.store(q_ptr + r64[:, None] * s_qm + cols[None, :], q, mask=live[:, None])
        tl.store(s_ptr + r64 * s_sm + kb, s_bits.to(tl.float32, bitcast=True), mask=live)

    @triton.jit
    def w8a8_kernel(
        xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, M, N, K, E,
        s_xm, s_xsm, s_we, s_wn, s_se, s_sn, s_sk, s_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DENSE: tl.constexpr,
    ):  # fmt: skip
        # BK = the scale block: one activation scale per row and one weight scale per column
        # at each reduction step. DENSE: one group of M rows, tile i its rows i * BM.. (no
        # tile map to build)
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        if DENSE:
            e = tile * 0  # an int32 scalar, as the map's
            row0 = tile * BM
            row_end = M
        else:
            e = tl.load(tile_expert_ptr + tile)
            row0 = tl.load(tile_row_ptr + tile)
            row_end = tl.load(row_end_ptr + tl.minimum(e, E - 1))
        if e < E:
            rm = row0 + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            rk = tl.arange(0, BK)
            live = rm < row_end
            a_ptrs = xq_ptr + rm[:, None].to(tl.int64) * s_xm + rk[None, :]
            b_ptrs = w_ptr + e.to(tl.int64) * s_we + rn[None, :].to(tl.int64) * s_wn + rk[:, None]
            as_ptrs = xs_ptr + rm.to(tl.int64) * s_xsm
            bs_ptrs = ws_ptr + e.to(tl.int64) * s_se + (rn // BK) * s_sn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, BK)):
                a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=rn[None, :] < N, other=0.0)
                a_s = tl.load(as_ptrs + kb, mask=live, other=0.0)
                b_s = tl.load(bs_ptrs + kb * s_sk, mask=rn < N, other=0.0)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
                a_ptrs += BK
                b_ptrs += BK
            o = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (rn[None, :] < N))

    return {"quantize": quantize_kernel, "w8a8": w8a8_kernel}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` as one kernel on CUDA (bitwise the same result)."""
    if not (x.is_cuda and kernels_on()):
        return quantize_rows_reference(x)
    r, k = x.shape
    if k % BLOCK:
        raise ValueError(f"rows of {k} columns are not whole {BLOCK}-column blocks")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((r, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((r, k // BLOCK), dtype=torch.float32, device=x.device)
    if r:
        br = 32
        _kernels()["quantize"][(-(-r // br), k // BLOCK)](
            x, q, s, r, x.stride(0), q.stride(0), s.stride(0), BR=br, BLOCK=BLOCK, num_warps=4
        )
    return q, s


def _scales(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from engine.checkpoint.quant import scales_fp32

    e, n, k = q.shape
    s = scales_fp32(scale)
    if s.shape != (e, -(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"scales {tuple(scale.shape)} do not cover {tuple(q.shape)} in {BLOCK}-blocks")
    return s


def w8a8_grouped_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    row_end: torch.Tensor,
    *,
    maps: TileMaps | None = None,
) -> torch.Tensor:
    """`grouped_matmul` with the activations quantised (``w8a8``; K a multiple of 128)."""
    from engine.kernels.grouped import shared_tile_map

    r, k = x.shape
    e, n, _ = q.shape
    s = _scales(q, scale)
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    xq, xs = quantize_rows(x)
    if q.stride(2) != 1:
        q = q.contiguous()
    bn, warps = (A8_WIDE_BN, A8_WIDE_WARPS) if _wide_tiles(r, e) else (A8_BN, A8_WARPS)
    if e == 1:  # a linear: tiles of consecutive rows
        expert = row = row_end
        tiles = -(-r // A8_BM)
    else:
        expert, row = shared_tile_map(row_end, r, A8_BM, maps)
        tiles = expert.shape[0]
    _kernels()["w8a8"][(tiles, -(-n // bn))](
        xq, xs, q, s, out, expert, row, row_end, r, n, k, e,
        xq.stride(0), xs.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1), s.stride(2),
        out.stride(0), BM=A8_BM, BN=bn, BK=BLOCK, DENSE=e == 1,
        num_warps=warps, num_stages=A8_STAGES,
    )  # fmt: skip
    return out


def _wide_tiles(rows: int, experts: int) -> bool:
    """Whether a ``w8a8`` grouped product takes the wide tiles: its experts average a whole
    row tile or more, outside the batch-invariant mode (where a row's tiles must not depend
    on its batch)."""
    from engine.kernels import batch_invariant

    return experts > 1 and rows >= experts * A8_BM and not batch_invariant.enabled()


def grouped_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    row_end: torch.Tensor,
    *,
    maps: TileMaps | None = None,
) -> torch.Tensor:
    """Rows x [R, K] grouped by expert (``row_end`` [E], int32, each group's end), FP8 weights
    q [E, N, K] with block scales [E, ceil(N/128), ceil(K/128)] -> [R, N] = x @ dequant(q[e]).T,
    in the process's compute mode (module docstring). ``maps``: tile maps shared with other
    products over the same rows (`grouped.shared_tile_map`)."""
    from engine.kernels.grouped import grouped_kernel, shared_tile_map

    r, k = x.shape
    if quantizes_activations(x, q):
        return w8a8_grouped_matmul(x, q, scale, row_end, maps=maps)
    e, n, _ = q.shape
    s = _scales(q, scale)
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    expert, row = shared_tile_map(row_end, r, BM, maps)
    grouped_kernel()[(expert.shape[0], -(-n // BN))](
        x, q, s, out, expert, row, row_end, n, k, e,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), q.stride(2), s.stride(0), s.stride(1), s.stride(2),
        out.stride(0), out.stride(1), BM=BM, BN=BN, BK=BK, SCALED=True, BLOCK=BLOCK,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


#: SMs whose tiles torch's block-scaled GEMM fills (an H200 has 132; `torch_block_pays`)
_SMS: dict[int, int] = {}


def torch_block_pays(x: torch.Tensor, n: int) -> bool:
    """Whether a dense ``w8a8`` product goes to torch's block-scaled FP8 GEMM (cuBLASLt's) rather
    than our kernel: outside the
    batch-invariant mode (its tiles are chosen from the shape), where torch has it, and where
    its 128 x 128 output tiles fill every SM at least twice. Measured on one H200 at
    flash-shape widths (docs/benchmarks.md, "FP8 weights against bf16"): it beats our kernel
    and bf16 from two waves of tiles up (4,096 rows x 4,096-32,768 columns) and loses below
    (4,096 x 1,024; 64 rows x 32,768)."""
    from engine.kernels import batch_invariant

    if batch_invariant.enabled() or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return -(-x.shape[0] // BLOCK) * -(-n // BLOCK) >= 2 * _SMS[dev]


def torch_block_linear(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """rows [M, K] quantised per 1 x 128 block, times q [N, K] with 128 x 128 block scales, by
    ``torch.nn.functional.scaled_mm`` (the scales in the layouts it asks for: the
    activations' outer-dim-major, the weight's transposed; rows padded to whole 128-row tiles,
    as cuBLASLt refused a row count that is not: CUBLAS_STATUS_NOT_SUPPORTED)."""
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    m = rows.shape[0]
    if m % BLOCK:  # cuBLASLt's block-scaled GEMM refuses some row counts: whole tiles only
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -m % BLOCK))
    xq, xs = quantize_rows(rows)
    ws = _scales(q.unsqueeze(0), scale.unsqueeze(0))[0]
    return scaled_mm(
        xq, q.t(), xs.t().contiguous().t(), ScalingType.BlockWise1x128, ws.t(), ScalingType.BlockWise128x128,
        swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=rows.dtype,
    )[:m]  # fmt: skip


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(q [N, K]).T with block scales [ceil(N/128), ceil(K/128)] -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if quantizes_activations(rows, q) and q.shape[0] % BLOCK == 0 and torch_block_pays(rows, q.shape[0]):
        return torch_block_linear(rows, q, scale).view(*x.shape[:-1], q.shape[0])
    end = torch.full((1,), rows.shape[0], dtype=torch.int32, device=x.device)
    out = grouped_matmul(rows, q.unsqueeze(0), scale.unsqueeze(0), end)
    return out.view(*x.shape[:-1], q.shape[0])
