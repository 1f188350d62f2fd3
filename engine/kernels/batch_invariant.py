"""Batch-invariant mode on CUDA: a token's results do not depend on the batch around it.

On a GPU, a library matmul picks its kernel (tile shape, split-K) from the problem's shape,
so the same row multiplied alone and inside a batch of 64 can be summed in a different order
and differ in the last bits; greedy tokens then drift apart after a few steps. This mode
routes the model's matmuls to Triton kernels whose configuration depends only on the
reduced and output widths (N, K), never on the number of rows M:

* ``aten::mm``, ``aten::addmm`` and ``aten::bmm`` on CUDA (``F.linear``, ``torch.einsum``,
  ``torch.matmul``) run ``_matmul``: fixed tiles, and a split of K chosen from (N, K) and the
  GPU's multiprocessor count. The split's fp32 partial sums are added in a fixed order.
* The routed experts' grouped GEMM runs `engine.kernels.grouped.grouped_matmul` with these
  fixed tiles: each tile holds rows of one expert.
* Decode and verification attention runs ``attend``: one program per (token, block of
  heads) walks the keys in blocks of fixed size with an online softmax; a block whose keys
  are all masked leaves the state exactly unchanged, so the padding a batch adds (a longer
  batch-mate, a CUDA-graph bucket) changes nothing.

Per-row elementwise kernels and per-row reductions of torch are left alone: tests/gpu
checks end to end that a request's logits are bitwise equal alone and in batches.

The mode is process-wide (the overrides are registered on the CUDA dispatch key, as
batch_invariant_ops, vLLM and SGLang do it) and is switched on once by ``enable``.
``enable("cpu")`` with ``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter, to
check their logic without a GPU (fp32 and fp16: the interpreter's bf16 products are wrong).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from engine.kernels import triton_available

_LOCK = threading.Lock()
_LIB: Any = None  # the torch.library registration, kept alive while the mode is on
_DEVICE_TYPE = "cuda"  # the tensors the mode covers

#: fixed tiles (rows, columns, reduced width) per input element size; autotuning is
#: deliberately absent: a tuned choice per M would break the invariance
TILES = {2: (64, 64, 64), 4: (32, 64, 32)}
NUM_WARPS, NUM_STAGES = 4, 3
#: the split of K aims at this many programs per multiprocessor for the narrowest M
SPLIT_TARGET = 2
#: and never gives a program fewer than this many reduced elements
MIN_K_PER_SPLIT = 256
ATTN_BLOCK_H, ATTN_BLOCK_K = 16, 32
MAX_GRID_Z = 65535


def enabled() -> bool:
    return _LIB is not None


def applies(t: torch.Tensor) -> bool:
    """Whether ``t``'s computation takes the mode's kernels (the mode is on, for its device)."""
    return _LIB is not None and t.device.type == _DEVICE_TYPE


def enable(device_type: str = "cuda") -> None:
    """Route mm/addmm/bmm of ``device_type`` tensors through the invariant kernels,
    process-wide. Idempotent. ``"cpu"`` runs them in Triton's interpreter
    (``TRITON_INTERPRET=1``): a check of the kernels' logic on a machine without a GPU."""
    global _LIB, _DEVICE_TYPE
    if not triton_available():
        raise RuntimeError("the batch-invariant mode needs Triton on a CUDA host")
    with _LOCK:
        if _LIB is not None:
            return
        key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm", _mm, key)
        lib.impl("addmm", _addmm, key)
        lib.impl("bmm", _bmm, key)
        _LIB, _DEVICE_TYPE = lib, device_type


def disable() -> None:
    """Give the ops back to torch (tests compare both modes in one process)."""
    global _LIB
    with _LOCK:
        if _LIB is not None:
            _LIB._destroy()
            _LIB = None


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter: an H200's count, so splits match it
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def k_split(n: int, k: int, elem: int, device: torch.device) -> tuple[int, int]:
    """(programs along K, reduced elements per program) for an [M, K] x [K, N] product: a
    function of N, K and the GPU only, never of M."""
    _, bn, bk = TILES[elem]
    want = max(1, (SPLIT_TARGET * _sm_count(device)) // _cdiv(n, bn))
    split = min(want, max(1, k // MIN_K_PER_SPLIT))
    per = _cdiv(_cdiv(k, split), bk) * bk  # a multiple of the tile's reduced width
    return _cdiv(k, per), per


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def matmul_kernel(
        a_ptr, b_ptr, c_ptr, M, N, K, k_per,
        s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cs, s_cb, s_cm, s_cn,
        SPLIT: tl.constexpr, IEEE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_z = tl.program_id(2)
        batch = pid_z // SPLIT
        split = pid_z % SPLIT
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        k_lo = split * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        a_base = a_ptr + batch.to(tl.int64) * s_ab
        b_base = b_ptr + batch.to(tl.int64) * s_bb
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            rk = (k0 + tl.arange(0, BK)).to(tl.int64)
            a = tl.load(
                a_base + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak,
                mask=(rm[:, None] < M) & (rk[None, :] < k_hi), other=0.0,
            )  # fmt: skip
            b = tl.load(
                b_base + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn,
                mask=(rk[:, None] < k_hi) & (rn[None, :] < N), other=0.0,
            )  # fmt: skip
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        c = c_ptr + split.to(tl.int64) * s_cs + batch.to(tl.int64) * s_cb
        c += rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def reduce_kernel(
        p_ptr, bias_ptr, out_ptr, total, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < total
        ptr = p_ptr + i
        acc = tl.load(ptr, mask=live, other=0.0)
        for _ in range(1, SPLIT):  # the partials in order: a fixed association
            ptr += total  # stepping the pointer: split * total may pass 2**31
            acc += tl.load(ptr, mask=live, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + i % N, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def attend_kernel(
        q_ptr, k_ptr, vis_ptr, sink_ptr, o_ptr, H, K, D, scale,
        s_qr, s_qh, s_kr, s_kk, s_vr, s_or, s_oh,
        BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, BD)
        hm = h < H
        q = tl.load(
            q_ptr + r * s_qr + h[:, None] * s_qh + d[None, :], mask=hm[:, None] & (d[None, :] < D), other=0.0
        )
        m = tl.full((BH,), float("-inf"), tl.float32)
        denom = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, BD), tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            vis = tl.load(vis_ptr + r * s_vr + kk, mask=km, other=0) != 0
            keys = tl.load(
                k_ptr + r * s_kr + kk[:, None] * s_kk + d[None, :],
                mask=km[:, None] & (d[None, :] < D),
                other=0.0,
            )
            s = tl.dot(q, tl.trans(keys)) * scale  # [BH, BK] fp32
            s = tl.where(vis[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # all keys so far masked: keep the state at zero (exp(-inf - -inf) would be nan);
            # a fully masked block after a visible one scales by exp(0) = 1 and adds 0: exact
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - base)
            p = tl.exp(s - base[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys)
            m = m_new
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)  # the sink joins the denominator only
        alpha = tl.exp(m - top)
        denom = denom * alpha + tl.exp(sink - top)
        out = acc * alpha[:, None] / denom[:, None]
        tl.store(
            o_ptr + r * s_or + h[:, None] * s_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=hm[:, None] & (d[None, :] < D),
        )

    return {
        "matmul": matmul_kernel, "reduce": reduce_kernel, "attend": attend_kernel,
    }  # fmt: skip


def check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(
            f"batch-invariant matmul takes matching bf16/fp16/fp32 operands, not {a.dtype} x {b.dtype}"
        )


def _matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, split_k: bool = False
) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] (+ bias [N]) -> [Bt, M, N] in a's dtype. ``split_k``
    (mm, addmm): split K by ``k_split``; a bmm never splits, so its batch size cannot matter."""
    check_operands(a, b)
    bt, m, k = a.shape
    n = b.shape[2]
    out = torch.empty((bt, m, n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    elem = a.element_size()
    bm, bn, bk = TILES[elem]
    split, per = k_split(n, k, elem, a.device) if split_k else (1, _cdiv(k, bk) * bk)
    if bt * split > MAX_GRID_Z:  # the grid's third axis is bounded: run the batch in parts
        step = MAX_GRID_Z // split
        for i in range(0, bt, step):
            out[i : i + step] = _matmul(a[i : i + step], b[i : i + step], bias, split_k)
        return out
    direct = split == 1 and bias is None
    dest = out if direct else torch.empty((split, bt, m, n), dtype=torch.float32, device=a.device)
    kern = _kernels()
    grid = (_cdiv(m, bm), _cdiv(n, bn), bt * split)
    s_cs = 0 if direct else dest.stride(0)
    c_strides = dest.stride()[-3:]
    kern["matmul"][grid](
        a, b, dest, m, n, k, per,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        s_cs, *c_strides,
        SPLIT=split, IEEE=a.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    if not direct:
        total = bt * m * n
        block = 1024
        kern["reduce"][(_cdiv(total, block),)](
            dest, dest if bias is None else bias.contiguous(), out, total, n,
            SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul(a[None], b[None], split_k=True)[0]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] and bias.dtype == a.dtype:
        return _matmul(a[None], b[None], bias, split_k=True)[0]
    out = _matmul(a[None], b[None], split_k=True)[0]  # elementwise from here: invariant as it is
    return out * alpha + bias * beta


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul(a, b)


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention of one query row per ``q`` row over its own keys (K == V), with sinks:
    q [R, H, D], keys [R, K, D], visible [R, K] bool, sinks [H] -> [R, H, D] in q's dtype.
    Keys are visited in blocks of ``ATTN_BLOCK_K`` from index 0; trailing masked keys change
    nothing, so a row's result depends on its own visible keys and their order only."""
    rows, h, d = q.shape
    k = keys.shape[1]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    q, keys = q.contiguous(), keys.contiguous()
    vis = visible.to(torch.uint8).contiguous()
    bd = max(16, 1 << (d - 1).bit_length())
    kern = _kernels()
    kern["attend"][(rows, _cdiv(h, ATTN_BLOCK_H))](
        q, keys, vis, sinks.float().contiguous(), out, h, k, d, d**-0.5,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), vis.stride(0), out.stride(0), out.stride(1),
        BH=ATTN_BLOCK_H, BK=ATTN_BLOCK_K, BD=bd, num_warps=8,
    )  # fmt: skip
    return out
