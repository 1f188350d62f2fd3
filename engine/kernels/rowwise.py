"""Memory-bound row operations of a step, one launch and one pass each.

* `rms_unweighted`: the per-head query norm, ``x * rsqrt(mean(x^2) + eps)`` with the mean in
  fp32 and the scale rounded to x's dtype before the product (the reference's order,
  `engine.model.norms.rms_unweighted`). Eagerly it is five kernels over an fp32 copy of the
  queries (~2 ms for a 4,096-token flash-shape step on an H200).
* `rms_weighted`: a weighted RMS norm (`engine.model.norms.RMSNorm`) in fp32 from the
  activations' dtype; eagerly an fp32 copy, the norm and a copy back, three passes.
* `index_reduce`: the CSA indexer's score of each entry, the head-weighted sum of the
  ReLU of the heads' dot products, in one read of the products (eagerly a ReLU pass and
  a batched matrix-vector product).
* `index_scores`: the same score fused with the dot products of shared entry keys: per
  tile of rows x entries, each head's q . k on tensor cores (bf16 in, fp32 out) goes
  through its ReLU and weight into the sum in registers, so the [rows, heads, entries]
  products (128 MB for 512 queries x 64 heads x 1,024 entries) never reach memory, and
  the indexer's tiles can be 64x larger for the same memory.
* `combine`: each token's weighted sum of its k expert outputs, read in place from the
  grouped GEMM's expert-major rows through the inverse permutation, summed in fp32 in the
  order k = 0, 1, ... (`engine.model.moe.combine`'s order), rounded once. Eagerly: a scatter
  back to token order, an fp32 copy of every row, a product and a sum.
* `swiglu`: the experts' clamped SwiGLU, ``silu(min(gate, limit)) * clamp(up, -limit,
  limit)``, read from the gate and up halves of the fused projection's rows in place, each
  intermediate rounded to the inputs' dtype where the eager code rounds it (the clamps, the
  SiLU, the product). Eagerly: two clamps, a SiLU and a product, four passes (0.9 ms for
  the routed experts of a 4,096-token flash-shape step of two layers on an H200).

One program per row (and block of columns): per token, so batch-invariant.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import kernels_on, tracks_grad

BLOCK_D = 1024
#: a norm's program covers this many elements (several rows when rows are short: one 512-wide
#: head per program left most of a 4,096-token flash-shape step's 262,144 programs waiting)
ROW_BLOCK_ELEMENTS = 4096
#: the indexer's reduction over heads: entries per program
INDEX_BLOCK_E = 256


@functools.cache
def _kernels() -> dict:  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def rms_kernel(
        x_ptr, w_ptr, o_ptr, R, D, eps, s_x, s_o, BR: tl.constexpr, BD: tl.constexpr, WEIGHTED: tl.constexpr
    ):  # fmt: skip
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        d = tl.arange(0, BD)
        m = (r < R)[:, None] & (d < D)[None, :]
        x = tl.load(x_ptr + r[:, None] * s_x + d[None, :], mask=m, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        if WEIGHTED:  # RMSNorm: all in fp32, rounded once
            y = xf * rstd * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        else:  # the unweighted norm rounds its scale to x's dtype first
            y = xf * rstd.to(x.dtype).to(tl.float32)
        tl.store(o_ptr + r[:, None] * s_o + d[None, :], y.to(o_ptr.dtype.element_ty), mask=m)

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

    @triton.jit
    def swiglu_kernel(g_ptr, u_ptr, o_ptr, D, s_g, s_u, s_o, limit, BD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        m = d < D
        dtype = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + r * s_g + d, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * s_u + d, mask=m, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit).to(dtype).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(o_ptr + r * s_o + d, (silu * u).to(dtype), mask=m)

    @triton.jit
    def index_reduce_kernel(s_ptr, w_ptr, o_ptr, NH, E, s_r, s_h, s_w, s_o, BE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        m = e < E
        acc = tl.zeros((BE,), tl.float32)
        for h in range(NH):  # heads in order: a row's sum is the same in any batch
            w = tl.load(w_ptr + r * s_w + h)
            acc += tl.maximum(tl.load(s_ptr + r * s_r + h * s_h + e, mask=m, other=0.0), 0.0) * w
        tl.store(o_ptr + r * s_o + e, acc, mask=m)

    @triton.jit
    def index_scores_kernel(
        q_ptr, k_ptr, w_ptr, o_ptr, R, E, NH, D, s_qr, s_qh, s_ke, s_wr, s_or,
        BR: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        e = (tl.program_id(1) * BE + tl.arange(0, BE)).to(tl.int64)
        d = tl.arange(0, BD)
        rm, em, dm = r < R, e < E, d < D
        kt = tl.trans(
            tl.load(k_ptr + e[:, None] * s_ke + d[None, :], mask=em[:, None] & dm[None, :], other=0.0)
        )
        acc = tl.zeros((BR, BE), tl.float32)
        for h in range(NH):  # heads in order, as `index_reduce_kernel`
            q = tl.load(
                q_ptr + r[:, None] * s_qr + h * s_qh + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0
            )
            w = tl.load(w_ptr + r * s_wr + h, mask=rm, other=0.0)
            acc += tl.maximum(tl.dot(q, kt), 0.0) * w[:, None]  # exact bf16 products, fp32 sums
        tl.store(o_ptr + r[:, None] * s_or + e[None, :], acc, mask=rm[:, None] & em[None, :])

    return {
        "index_reduce": index_reduce_kernel, "index_scores": index_scores_kernel,
        "rms": rms_kernel, "combine": combine_kernel,
        "swiglu": swiglu_kernel,
    }  # fmt: skip


def usable(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """CUDA ``x``, with Triton, outside autograd (``others``: the op's other inputs)."""
    return x.is_cuda and kernels_on() and not tracks_grad(x, *others)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        bd = max(16, 1 << (d - 1).bit_length())
        br = max(1, ROW_BLOCK_ELEMENTS // bd)  # rows per program: a function of D alone
        w = rows if weight is None else weight.contiguous()  # unread without a weight
        _kernels()["rms"][(-(-rows.shape[0] // br),)](
            rows, w, out, rows.shape[0], d, eps, rows.stride(0), out.stride(0), BR=br, BD=bd,
            WEIGHTED=weight is not None, num_warps=8 if d > 2048 else 4,
        )  # fmt: skip
    return out.view(x.shape)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (D <= 8192) -> the unweighted RMS norm of each row, in x's dtype."""
    return _rms(x, None, eps)


def rms_weighted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (D <= 8192) -> ``rms_norm(x.float(), weight)`` in x's dtype: the norm in fp32
    from x's own dtype, no fp32 copy of x."""
    return _rms(x, weight, eps)


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


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [N, I] (rows may be strided, e.g. halves of one [N, 2I]) -> [N, I] in their dtype."""
    n, d = gate.shape
    out = torch.empty(n, d, dtype=gate.dtype, device=gate.device)
    if n:
        _kernels()["swiglu"][(n, -(-d // BLOCK_D))](
            gate, up, out, d, gate.stride(0), up.stride(0), out.stride(0), float(limit), BD=BLOCK_D
        )
    return out


def index_reduce(dots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_h w[r, h] * relu(dots[r, h, e])`` in fp32: dots [R, nI, E] (fp32, entries
    contiguous), w [R, nI] -> [R, E]."""
    r, nh, e = dots.shape
    w = w.float().contiguous()
    out = torch.empty(r, e, dtype=torch.float32, device=dots.device)
    if r and e:
        _kernels()["index_reduce"][(r, -(-e // INDEX_BLOCK_E))](
            dots, w, out, nh, e, dots.stride(0), dots.stride(1), w.stride(0), out.stride(0), BE=INDEX_BLOCK_E
        )
    return out


#: (rows, entries, warps, stages) of `index_scores`' programs: of 8 configurations swept on the
#: H200, the fastest at 4,096 queries x 4,096 entries and 256 x 32,768, within 8 % of
#: the fastest at 4,096 x 1,024 (docs/benchmarks.md, "The indexer's scores fused")
INDEX_SCORE_TILES = (64, 128, 4, 2)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h w[r, h] * relu(q[r, h] . keys[e])`` in fp32 without the per-head products in
    memory: q [R, nI, dI] and keys [E, dI] bf16 (dI <= 256), w [R, nI] -> [R, E]. Each
    product is exact (bf16 in, fp32 out) and the heads are summed in order, as `index_reduce`
    sums `engine.model.compressor`'s tensor-core products; the products' own fp32 sums may
    run in another order than cuBLAS's."""
    r, nh, d = q.shape
    e = keys.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    w = w.float().contiguous()
    out = torch.empty(r, e, dtype=torch.float32, device=q.device)
    if r and e:
        br, be, warps, stages = INDEX_SCORE_TILES
        _kernels()["index_scores"][(-(-r // br), -(-e // be))](
            q, keys, w, out, r, e, nh, d, q.stride(0), q.stride(1), keys.stride(0), w.stride(0), out.stride(0),
            BR=br, BE=be, BD=max(16, 1 << (d - 1).bit_length()), num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out
