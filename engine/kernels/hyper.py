"""mHC's per-token work on the ``n`` residual streams: the mixing weights' projection and the
two mixes, one pass over the streams each.

* `premix`: ``mixes = rms_unweighted(flat) @ fn^T`` in fp32, ``flat`` the token's streams
  flattened to ``n * D`` (the projection the pre, post and comb weights come from);
  `hc_weights` finishes it into the block's pre, post and Sinkhorn-normalised comb weights
  in the same second launch (eagerly a dozen tiny kernels and the Sinkhorn kernel per
  hyper-connection, two per layer);
* `collapse`: ``x = sum_j pre[j] * streams[j]`` (the block's input), and
* `merge`: ``streams'[i] = post[i] * out + sum_j comb[j, i] * streams[j]`` (its output).

Eagerly the premix is an fp32 copy of the streams, an RMS norm over it and an fp32 matmul
with 24 outputs that cuBLAS runs without tensor cores (2.1 ms for 4,096 tokens of two
flash-shape layers on an H200). The kernel reads the streams once: (row block, slice of
``n * D``) programs each take their slice's sum of squares and its products with ``fn``.
For bf16 streams the fp32 ``fn`` is split into three bf16 parts (hi + mid + lo carry its 24
bits) and each part's product runs on tensor cores: bf16 x bf16 products are exact in the
fp32 accumulator, so this is an fp32 product up to the order of the sums (``tl.dot`` in
plain fp32 emulates it with FMAs, ~10x slower on an H200). A second launch adds the `PREMIX_SPLIT` slices in order and
scales by ``rsqrt(mean + eps)``: ``(x / rms) @ fn^T`` computed as ``(x @ fn^T) / rms``, equal
up to fp32 rounding. The split depends on ``n * D`` alone, so a row's sums are the same in
any batch.

Eagerly the merge is a ``[T, n, n] @ [T, n, D]`` batched matmul that cuBLAS runs as T tiny
products (1.25 ms for 4,096 tokens at flash-shape widths on an H200, for ~0.3 GB of traffic),
and the collapse materialises an fp32 ``[T, n, D]`` product. Each kernel reads the streams
once: one program per (token, block of D). The roundings are the eager code's: ``post`` and
``comb`` rounded to the streams' dtype, each product exact in fp32, ``post * out`` and the
matmul rounded to the streams' dtype before their sum, which is rounded again; the
collapse sums in fp32 and rounds once. Per token, so batch-invariant.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import kernels_on, tracks_grad

BLOCK_D = 1024
#: premix: rows and reduced width per program, and the slices ``n * D`` is cut into (each at
#: least PREMIX_MIN_SLICE wide): the slices, not the rows, fill the GPU when a decode step
#: has a handful of rows. Measured on an H200 (hc_weights at flash-shape widths, n*D = 16,384,
#: us per call at 1 / 64 / 4,096 rows): 8 slices 30.8 / 45.5 / 72.5, 16: 18.3 / 26.0 / 78.1,
#: 32: 12.4 / 16.6 / 84.6, 64: 9.3 / 13.2 / 101.1. 32 saves ~90 us of a batch-1 decode step
#: (five calls) for ~0.1 ms of a 19 ms 4,096-token prefill step (eight calls).
PREMIX_BM, PREMIX_BK = 64, 64
PREMIX_SLICES, PREMIX_MIN_SLICE = 32, 512


@functools.cache
def _kernels() -> dict:  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def collapse_kernel(s_ptr, pre_ptr, o_ptr, D, s_t, s_n, p_t, o_t, N: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        j = tl.arange(0, N)
        dm = d < D
        s = tl.load(s_ptr + t * s_t + j[:, None] * s_n + d[None, :], mask=dm[None, :], other=0.0).to(
            tl.float32
        )
        pre = tl.load(pre_ptr + t * p_t + j).to(tl.float32)
        x = tl.sum(pre[:, None] * s, axis=0)
        tl.store(o_ptr + t * o_t + d, x.to(o_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def merge_kernel(
        s_ptr, out_ptr, post_ptr, comb_ptr, r_ptr, D, s_t, s_n, o_t, p_t, c_t, r_t, r_n,
        N: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        j = tl.arange(0, N)
        dm = d < D
        dtype = r_ptr.dtype.element_ty
        s = tl.load(s_ptr + t * s_t + j[:, None] * s_n + d[None, :], mask=dm[None, :], other=0.0).to(
            tl.float32
        )
        out = tl.load(out_ptr + t * o_t + d, mask=dm, other=0.0).to(tl.float32)
        for i in tl.static_range(N):
            post = tl.load(post_ptr + t * p_t + i).to(dtype).to(tl.float32)
            comb = tl.load(comb_ptr + t * c_t + j * N + i).to(dtype).to(tl.float32)  # column i
            a = (post * out).to(dtype).to(tl.float32)
            b = tl.sum(comb[:, None] * s, axis=0).to(dtype).to(tl.float32)
            tl.store(r_ptr + t * r_t + i * r_n + d, (a + b).to(dtype), mask=dm)

    @triton.jit
    def premix_kernel(
        x_ptr, w_ptr, part_ptr, sq_ptr, T, K, M, s_x, slice_k,
        BM: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, SPLIT_W: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        sl = tl.program_id(1)
        rm = rows < T
        cols = tl.arange(0, MP)
        cm = cols < M
        acc = tl.zeros((BM, MP), tl.float32)
        sq = tl.zeros((BM,), tl.float32)
        for k0 in range(sl * slice_k, tl.minimum(sl * slice_k + slice_k, K), BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            xs = x_ptr + rows[:, None].to(tl.int64) * s_x + k[None, :]
            x = tl.load(xs, mask=rm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=cm[None, :] & km[:, None], other=0.0)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            if SPLIT_W:  # bf16 x: w = hi + mid + lo in bf16, three exact-product MMAs, smallest first
                hi = w.to(tl.bfloat16)
                rest = w - hi.to(tl.float32)
                mid = rest.to(tl.bfloat16)
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(x, lo, acc)
                acc = tl.dot(x, mid, acc)
                acc = tl.dot(x, hi, acc)
            else:
                acc += tl.dot(xf, w, input_precision="ieee")
        out = (sl * T + rows).to(tl.int64)
        tl.store(part_ptr + out[:, None] * MP + cols[None, :], acc, mask=rm[:, None])
        tl.store(sq_ptr + out, sq, mask=rm)

    @triton.jit
    def premix_finish_kernel(
        part_ptr, sq_ptr, o_ptr, T, K, M, eps, SLICES: tl.constexpr, MP: tl.constexpr
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, MP)
        acc = tl.zeros((MP,), tl.float32)
        sq = 0.0
        for sl in tl.static_range(SLICES):  # in slice order: the same sums in any batch
            acc += tl.load(part_ptr + (sl * T + t) * MP + cols)
            sq += tl.load(sq_ptr + sl * T + t)
        tl.store(o_ptr + t * M + cols, acc * tl.rsqrt(sq / K + eps), mask=cols < M)

    @triton.jit
    def hc_weights_kernel(
        part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, eps, hc_eps, iters,
        SLICES: tl.constexpr, MP: tl.constexpr, N: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, N)
        r = tl.arange(0, N)[:, None]
        c = tl.arange(0, N)[None, :]
        a_pre = tl.zeros((N,), tl.float32)
        a_post = tl.zeros((N,), tl.float32)
        a_comb = tl.zeros((N, N), tl.float32)
        sq = 0.0
        for sl in tl.static_range(SLICES):  # in slice order: the same sums in any batch
            row = part_ptr + (sl * T + t) * MP
            a_pre += tl.load(row + i)
            a_post += tl.load(row + N + i)
            a_comb += tl.load(row + 2 * N + r * N + c)
            sq += tl.load(sq_ptr + sl * T + t)
        rs = tl.rsqrt(sq / K + eps)
        # HyperConnection.forward's order: mixes, then scale, base, the activations
        pre = tl.sigmoid(a_pre * rs * tl.load(scale_ptr) + tl.load(base_ptr + i)) + hc_eps
        post = 2 * tl.sigmoid(a_post * rs * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i))
        x = a_comb * rs * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + r * N + c)
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        m = e / tl.sum(e, axis=1)[:, None] + hc_eps
        m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)  # Sinkhorn: columns, then rows and columns
        for _ in range(iters - 1):
            m = m / (tl.sum(m, axis=1)[:, None] + hc_eps)
            m = m / (tl.sum(m, axis=0)[None, :] + hc_eps)
        tl.store(pre_ptr + t * N + i, pre)
        tl.store(post_ptr + t * N + i, post)
        tl.store(comb_ptr + t * N * N + r * N + c, m)

    return {
        "collapse": collapse_kernel, "merge": merge_kernel,
        "premix": premix_kernel, "premix_finish": premix_finish_kernel, "hc_weights": hc_weights_kernel,
    }  # fmt: skip


def usable(streams: torch.Tensor, *others: torch.Tensor) -> bool:
    """CUDA streams [T, n, D] with n a power of two, with Triton, outside autograd (``others``:
    the op's other inputs)."""
    n = streams.shape[1] if streams.dim() == 3 else 0
    return (
        streams.is_cuda and n > 0 and n & (n - 1) == 0 and kernels_on() and not tracks_grad(streams, *others)
    )


def premix_slices(k: int) -> int:
    """How many slices a reduced width ``k`` (``n * D``) is cut into: `PREMIX_SLICES`, fewer
    where a slice would be narrower than `PREMIX_MIN_SLICE`. A function of ``k`` alone."""
    return max(1, min(PREMIX_SLICES, k // PREMIX_MIN_SLICE))


def _premix_parts(streams: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The premix's per-slice partial products [slices, T, MP] and sums of squares [slices, T]
    (first launch), with the slice count and MP (M padded to a power of two, at least 16)."""
    t, n, d = streams.shape
    m, k = fn.shape
    flat = streams.reshape(t, n * d)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    fn = fn.float().contiguous()
    slices = premix_slices(k)
    slice_k = -(-k // slices)
    slice_k = -(-slice_k // PREMIX_BK) * PREMIX_BK
    slices = -(-k // slice_k)
    mp = max(16, 1 << (m - 1).bit_length())
    part = torch.empty(slices, t, mp, dtype=torch.float32, device=streams.device)
    sq = torch.empty(slices, t, dtype=torch.float32, device=streams.device)
    if t:
        _kernels()["premix"][(-(-t // PREMIX_BM), slices)](
            flat, fn, part, sq, t, k, m, flat.stride(0), slice_k, BM=PREMIX_BM, BK=PREMIX_BK, MP=mp,
            SPLIT_W=flat.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return part, sq, slices, mp


def hc_weights(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float, iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A block's mHC weights from its streams [T, n, D] in two launches: the premix, then per
    token the pre / post activations, comb's softmax and its Sinkhorn normalisation
    (`engine.model.hyper.HyperConnection.forward`'s operations in its order, fp32). fn
    [(2+n)*n, n*D], base [(2+n)*n], scale [3] -> pre [T, n], post [T, n], comb [T, n, n]."""
    t, n, _ = streams.shape
    part, sq, slices, mp = _premix_parts(streams, fn)
    pre = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    if t:
        _kernels()["hc_weights"][(t,)](
            part, sq, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
            t, fn.shape[1], eps, hc_eps, iters, SLICES=slices, MP=mp, N=n, num_warps=1,
        )  # fmt: skip
    return pre, post, comb


def premix(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, n, D] (any float dtype), fn [M, n*D] (fp32) -> the fp32 mixes [T, M] of the
    RMS-normalised flattened streams."""
    t = streams.shape[0]
    m, k = fn.shape
    part, sq, slices, mp = _premix_parts(streams, fn)
    out = torch.empty(t, m, dtype=torch.float32, device=streams.device)
    if t:
        _kernels()["premix_finish"][(t,)](part, sq, out, t, k, m, eps, SLICES=slices, MP=mp, num_warps=1)
    return out


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, n, D], pre [T, n] (fp32) -> [T, D] in the streams' dtype."""
    t, n, d = streams.shape
    streams, pre = streams.contiguous(), pre.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        _kernels()["collapse"][(t, -(-d // BLOCK_D))](
            streams, pre, out, d, streams.stride(0), streams.stride(1), pre.stride(0), out.stride(0),
            N=n, BD=BLOCK_D,
        )  # fmt: skip
    return out


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, n, D], out [T, D], post [T, n], comb [T, n, n] -> [T, n, D]."""
    t, n, d = streams.shape
    streams, out, post, comb = streams.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous()
    res = torch.empty_like(streams)
    if t:
        _kernels()["merge"][(t, -(-d // BLOCK_D))](
            streams, out, post, comb, res, d, streams.stride(0), streams.stride(1), out.stride(0),
            post.stride(0), comb.stride(0), res.stride(0), res.stride(1), N=n, BD=BLOCK_D,
        )  # fmt: skip
    return res
