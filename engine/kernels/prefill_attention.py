"""Prefill attention over the sliding window plus compressed entries, with sinks, in one launch.

`engine.model.prefill.attend_sequence` gathers every query's keys into a ``[c, W + k, hd]``
tensor and attends with batched matmuls: at flash-shape widths (64 heads x 512) that copy
and its logits were most of a 4,096-token prefill's time. This kernel reads the keys where
they are:

* the window of query ``i`` is rows ``i .. i + W - 1`` of the step's raw rows
  (`engine.model.prefill.window_rows`), visible from row ``lead`` on;
* an HCA layer's entries are rows ``0 .. (p + 1) // rate - 1`` of the sequence's entries;
* a CSA layer's are the rows its indexer chose (``idx`` [n, k], -1 where none).

One program per (query, block of ``BH`` heads) walks the window, then the entries, in blocks
of ``BK`` keys with an online softmax in fp32; the sink joins the denominator at the end.
Masked keys contribute exact zeros, so a query's result depends on its own keys only.
The batch-invariant mode keeps its own kernel (`engine.kernels.batch_invariant.attend`),
which decode and verification share.
"""

from __future__ import annotations

import functools
import math

import torch

from engine.kernels import kernels_on

#: heads per program, keys per block, warps, pipeline stages. Swept once on an H200
#: (2026-12-03; flash-shape, 4,096 queries, window 128 + 512 CSA entries each; BH 16/32/64 x
#: BK 16/32/64 x 4/8 warps x 1-3 stages): (64, 32, 8, 2) took 2.46 ms, window only 0.59 ms;
#: (16, 32, 8, 2) 7.3 / 1.5 ms; (32, 32, 4, 1) 3.1 / 0.58 ms. All 64 heads in one program
#: read each key once per query.
BLOCK_H, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 32, 8, 2
#: no key walk: MODE_NONE (window only), MODE_DENSE (HCA: every complete entry), MODE_INDEXED (CSA)
MODE_NONE, MODE_DENSE, MODE_INDEXED = 0, 1, 2


@functools.cache
def _kernel():  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_attention_kernel(
        q_ptr, raw_ptr, ent_ptr, idx_ptr, sink_ptr, o_ptr,
        H, n0, lead, rate, n_idx, scale_log2,
        s_qt, s_qh, s_raw, s_ent, s_idx, s_ot, s_oh,
        W: tl.constexpr, MODE: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, D)
        hm = h < H
        q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hm[:, None], other=0.0)
        m = tl.full((BH,), float("-inf"), tl.float32)
        denom = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, D), tl.float32)
        if MODE == 1:  # every entry complete at this query
            n_ent = (n0 + t + 1) // rate
        elif MODE == 2:  # the indexer's choice
            n_ent = n_idx
        else:
            n_ent = 0
        # key j < W: raw row t + j (the window); key j >= W: entry j - W, or idx[t, j - W]
        for k0 in range(0, W + n_ent, BK):
            j = k0 + tl.arange(0, BK)
            in_win = j < W
            row = t + j
            win_ok = in_win & (row >= lead)
            je = j - W
            if MODE == 2:
                e = tl.load(idx_ptr + t * s_idx + je, mask=(je >= 0) & (je < n_ent), other=-1).to(tl.int64)
            else:
                e = je.to(tl.int64)
            ent_ok = (je >= 0) & (je < n_ent) & (e >= 0)
            kw = tl.load(raw_ptr + row[:, None] * s_raw + d[None, :], mask=win_ok[:, None], other=0.0)
            ke = tl.load(ent_ptr + e[:, None] * s_ent + d[None, :], mask=ent_ok[:, None], other=0.0)
            keys = tl.where(in_win[:, None], kw, ke)
            valid = win_ok | ent_ok
            s = tl.dot(q, tl.trans(keys)) * scale_log2  # [BH, BK] fp32, base-2 logits
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: stay at 0
            alpha = tl.exp2(m - base)
            p = tl.exp2(s - base[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys)
            m = m_new
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m, sink)  # the sink joins the denominator only
        alpha = tl.exp2(m - top)
        denom = denom * alpha + tl.exp2(sink - top)
        out = acc * alpha[:, None] / denom[:, None]
        tl.store(
            o_ptr + t * s_ot + h[:, None] * s_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=hm[:, None],
        )

    return prefill_attention_kernel


def usable(q: torch.Tensor) -> bool:
    """CUDA bf16/fp16 queries whose head width is a power of two (V4: 512), with Triton."""
    d = q.shape[-1]
    return (
        q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d >= 16 and d & (d - 1) == 0
        and kernels_on()
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,  # [n, H, hd]
    raw: torch.Tensor,  # [n + W - 1, hd] (engine.model.prefill.window_rows)
    n0: int,
    lead: int,  # first visible raw row
    window: int,
    sinks: torch.Tensor,  # [H]
    entries: torch.Tensor | None = None,  # [E, hd]
    rate: int = 1,
    idx: torch.Tensor | None = None,  # [n, k] entry ids, -1: none (CSA); None with entries: HCA
    out: torch.Tensor | None = None,  # [n, H, hd], channels contiguous: written in place
) -> torch.Tensor:
    """Attention output [n, H, hd] (module docstring), in ``out`` when given."""
    n, h, d = q.shape
    q, raw = q.contiguous(), raw.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError("prefill_attention: out must be shaped as q, its channels contiguous")
    if n == 0:
        return out
    mode = MODE_NONE if entries is None else (MODE_DENSE if idx is None else MODE_INDEXED)
    ent = raw if entries is None else entries.to(q.dtype).contiguous()
    ids = (
        torch.zeros(1, 1, dtype=torch.int32, device=q.device)
        if idx is None
        else idx.to(torch.int32).contiguous()
    )
    _kernel()[(n, -(-h // BLOCK_H))](
        q, raw, ent, ids, sinks.float().contiguous(), out,
        h, n0, lead, rate, ids.shape[1] if idx is not None else 0, d**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), raw.stride(0), ent.stride(0), ids.stride(0), out.stride(0), out.stride(1),
        W=window, MODE=mode, BH=BLOCK_H, BK=BLOCK_K, D=d, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
