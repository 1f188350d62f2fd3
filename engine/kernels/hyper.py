"""mHC's two per-token mixes of the ``n`` residual streams, one launch each.

* `collapse`: ``x = sum_j pre[j] * streams[j]`` (the block's input), and
* `merge`: ``streams'[i] = post[i] * out + sum_j comb[j, i] * streams[j]`` (its output).

Eagerly the merge is a ``[T, n, n] @ [T, n, D]`` batched matmul that cuBLAS runs as T tiny
products (1.25 ms for 4,096 tokens at flash-shape widths on an H200, for ~0.3 GB of traffic),
and the collapse materialises an fp32 ``[T, n, D]`` product. Each kernel reads the streams
once: one program per (token, block of D). The roundings are the eager code's: ``post`` and
``comb`` rounded to the streams' dtype, each product exact in fp32, ``post * out`` and the
matmul rounded to the streams' dtype before their sum, which is rounded again; the
collapse sums in fp32 and rounds once. Per token, so batch-invariant.
"""

from __future__ import annotations

import torch

from engine.kernels import kernels_on

BLOCK_D = 1024


def _build():  # built on first use, so importing this module never needs Triton
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

    return {"collapse": collapse_kernel, "merge": merge_kernel}


_KERNELS: dict | None = None


def usable(streams: torch.Tensor) -> bool:
    """CUDA streams [T, n, D] with n a power of two, with Triton."""
    n = streams.shape[1] if streams.dim() == 3 else 0
    return streams.is_cuda and n > 0 and n & (n - 1) == 0 and kernels_on()


def _kernels() -> dict:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build()
    return _KERNELS


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
