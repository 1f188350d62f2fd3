"""KV compressors (CSA rate 4 with overlapping windows, HCA rate 128 dense) and the lightning indexer.

All three share one step: project the new tokens to (kv, gate), join them with the slot's
ring of earlier projections, emit one entry per window that closes in this step, normalise,
rotate at position ``w * rate`` and store the entry in the paged pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.kernels import batch_invariant, kernels_on, pooling, rowwise
from engine.model.norms import RMSNorm
from engine.model.rope import Rotary


class Compressor(nn.Module):
    """Softmax-gated pooling of ``rate`` tokens (two overlapping series Ca|Cb when ``overlap``)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def step(
        self,
        rotary: Rotary,
        kv_new: torch.Tensor,  # [q, C] projections of this sequence's new tokens
        gate_new: torch.Tensor,  # [q, C]
        n0: int,  # tokens computed before this step
        ring_kv: torch.Tensor,  # [num_slots, R, C]
        ring_gate: torch.Tensor,
        slot: int,
        keep_until: int = 0,  # the ring holds exact state below this position: do not overwrite it
    ) -> tuple[int, torch.Tensor]:
        """Return (first entry index, entries [n_new, dim]) for windows closing in [n0, n0+q); update the ring."""
        m, d = self.rate, self.dim
        kv_new = SWASlots.with_kept(ring_kv, slot, n0, kv_new, keep_until)
        gate_new = SWASlots.with_kept(ring_gate, slot, n0, gate_new, keep_until)
        n1 = n0 + kv_new.shape[0]
        w0, w1 = n0 // m, n1 // m
        entries = kv_new.new_zeros(0, d)
        if w1 > w0:
            lo = max(0, w0 * m - (m if self.overlap else 0))
            all_kv = torch.cat([SWASlots.ring_read(ring_kv, slot, lo, n0), kv_new], dim=0)  # [n1 - lo, C]
            all_gate = torch.cat([SWASlots.ring_read(ring_gate, slot, lo, n0), gate_new], dim=0)
            a, nw = w0 * m - lo, w1 - w0  # window w0's first row, the closing windows
            if pooling.usable(all_kv):  # `_pool` in one kernel
                pooled = pooling.pool(all_kv, all_gate, self.position_bias, a, w0, nw, m, d, self.overlap)
            else:
                pooled = self._pool(all_kv, all_gate, a, w0, nw)  # [nw, d]
            pos = torch.arange(w0, w1, device=kv_new.device) * m
            entries = rotary(self.kv_norm(pooled), pos)
        SWASlots.ring_write_from(ring_kv, slot, n0, kv_new, keep_until)
        SWASlots.ring_write_from(ring_gate, slot, n0, gate_new, keep_until)
        return w0, entries

    def _pool(self, all_kv: torch.Tensor, all_gate: torch.Tensor, a: int, w0: int, nw: int) -> torch.Tensor:
        """Pooled rows [nw, dim] of windows ``w0 ..`` from the step's rows ``all_kv`` / ``all_gate``
        [L, C] (window ``w0`` starts at row ``a``)."""
        m, d = self.rate, self.dim
        cur_kv = all_kv[a : a + nw * m].view(nw, m, -1)  # [nw, m, C]
        cur_gate = all_gate[a : a + nw * m].view(nw, m, -1) + self.position_bias  # fp32
        if self.overlap:
            kv = cur_kv.new_zeros(nw, 2 * m, d)
            gate = cur_gate.new_full((nw, 2 * m, d), float("-inf"))
            kv[:, m:], gate[:, m:] = cur_kv[..., d:], cur_gate[..., d:]
            # Ca half of the previous window (positions [w*m - m, w*m)); window 0 has none.
            first_prev = 1 if w0 == 0 else 0
            if nw > first_prev:
                b = a + (first_prev - 1) * m
                cnt = nw - first_prev
                prev_kv = all_kv[b : b + cnt * m].view(cnt, m, -1)
                prev_gate = all_gate[b : b + cnt * m].view(cnt, m, -1) + self.position_bias
                kv[first_prev:, :m], gate[first_prev:, :m] = prev_kv[..., :d], prev_gate[..., :d]
        else:
            kv, gate = cur_kv, cur_gate
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


# On the CPU, scores whose rows are at least SELECT_MIN_RATIO times k long and that hold at
# least SELECT_MIN_ELEMENTS scores take `_topk_by_selection`; below either its fixed cost (a
# topk, two sorts of k and a compare over the row: ~0.1 ms) outweighs what it saves. Measured
# crossovers: about 4x k (16 rows of 1,024, k = 256), and between 2,048 and 4,096 scores for
# one row; 8x leaves a margin (docs/engine.md, "The indexer's top-k on the CPU")
SELECT_MIN_RATIO = 8
SELECT_MIN_ELEMENTS = 4096


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, in descending score order; equal scores resolve
    to the lowest index, so the choice does not depend on row length, padding, chunking or
    batch-mates (batch invariance). ``torch.topk`` leaves ties implementation-defined; ReLU
    scores tie at 0 often. Defined as the first k of a stable descending sort; long rows on
    the CPU take an equal, cheaper path (`_topk_by_selection`)."""
    n = scores.shape[-1]
    k = min(k, n)
    if (
        scores.device.type == "cpu"
        and k > 0
        and n >= SELECT_MIN_RATIO * k
        and scores.numel() >= SELECT_MIN_ELEMENTS
    ):
        return _topk_by_selection(scores.reshape(-1, n), k).view(*scores.shape[:-1], k)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _topk_by_selection(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_lowest_index` of a 2-D CPU tensor through ``torch.topk`` (a selection, where the
    sort it replaces orders the whole row). topk's set is the stable sort's wherever the k-th
    score ties with no score outside the set; those rows are ordered by (score descending,
    index ascending), the rest (a tie at the boundary, -inf padding past a short row's
    entries, NaN) are sorted as the definition says. A data-dependent branch: CPU only."""
    values, ids = torch.topk(scores, k, dim=-1, sorted=False)
    kth = values.amin(dim=-1, keepdim=True)
    tied = (scores >= kth).sum(dim=-1) != k
    ids = ids.sort(dim=-1).values  # index order, so the stable sort below breaks ties low-first
    out = ids.gather(-1, torch.sort(scores.gather(-1, ids), dim=-1, descending=True, stable=True).indices)
    if tied.any():
        out[tied] = torch.sort(scores[tied], dim=-1, descending=True, stable=True).indices[:, :k]
    return out


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim plus multi-head ReLU
    scoring (`index_scores`; the top-k: `engine.model.prefill.select_topk` in prefill, in
    tiles, and `engine.model.decode` for decode and verification)."""

    def __init__(
        self, hidden: int, q_lora: int, dim: int, n_heads: int, rate: int, topk: int, eps: float
    ) -> None:
        super().__init__(hidden, dim, rate, overlap=True, eps=eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora, n_heads * dim, bias=False)
        self.scorer = IndexerScorer(hidden, n_heads)

    def queries(
        self, rotary: Rotary, q_latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [T, nI, dI] (rotated at the query positions), head weights [T, nI] (fp32)."""
        q = self.q_b_proj(q_latent).view(q_latent.shape[0], self.n_heads, self.dim)
        q = rotary(q, positions)
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5
        return q, w


def _dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Every q_h . k in fp32: q [R, nI, dI], keys [E, dI] or [R, E, dI] -> [R, nI, E]. bf16
    inputs on CUDA multiply on tensor cores into fp32 (their products are exact in fp32 and
    the sums fp32, as in the fp32 einsum, which cuBLAS runs without tensor cores); elsewhere,
    and in the batch-invariant mode, fp32 copies."""
    if (
        q.is_cuda
        and q.dtype == keys.dtype == torch.bfloat16
        and kernels_on()
        and not batch_invariant.enabled()
    ):
        if keys.dim() == 2:
            return torch.mm(q.reshape(-1, q.shape[-1]), keys.t(), out_dtype=torch.float32).view(
                *q.shape[:2], -1
            )
        return torch.bmm(q, keys.transpose(1, 2), out_dtype=torch.float32)
    eq = "rhd,ed->rhe" if keys.dim() == 2 else "rhd,red->rhe"
    return torch.einsum(eq, q.float(), keys.float())


def fused_index_scores(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `index_scores` runs as one kernel (`rowwise.index_scores`: no per-head products
    in memory): keys shared by every row, bf16 on CUDA with the kernels on, outside the
    batch-invariant mode (which keeps its fixed-order einsum)."""
    return (
        keys.dim() == 2 and q.dtype == keys.dtype == torch.bfloat16 and q.shape[-1] <= 256
        and rowwise.usable(q, keys) and not batch_invariant.enabled()
    )  # fmt: skip


def index_scores(ix: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h relu(q_h . k) / sqrt(dI)`` in fp32: queries q [R, nI, dI], head weights
    w [R, nI] and entry keys shared by every row ([E, dI]) or per row ([R, E, dI]) -> [R, E]."""
    if fused_index_scores(q, keys):
        return rowwise.index_scores(q, w * ix.dim**-0.5, keys)
    dots = _dots(q, keys)  # a new tensor
    if batch_invariant.enabled():  # a matmul: its order is fixed; torch's sum's is not
        return torch.einsum("rhe,rh->re", F.relu(dots) * ix.dim**-0.5, w)
    w = w * ix.dim**-0.5  # 1/sqrt(dI) folded into the head weights
    if rowwise.usable(dots) and dots.stride(-1) == 1:
        return rowwise.index_reduce(dots, w)  # one read of the products
    return torch.bmm(w.unsqueeze(1), dots.relu_()).squeeze(1)  # ReLU in place, one matvec


class CSACompressor(Compressor):
    def __init__(self, hidden: int, head_dim: int, rate: int, eps: float, indexer: Indexer) -> None:
        super().__init__(hidden, head_dim, rate, overlap=True, eps=eps)
        self.indexer = indexer


class HCACompressor(Compressor):
    def __init__(self, hidden: int, head_dim: int, rate: int, eps: float) -> None:
        super().__init__(hidden, head_dim, rate, overlap=False, eps=eps)


def run_compressor(
    comp: Compressor,
    rotary: Rotary,
    x: torch.Tensor,  # [T, hidden] attention input (normed)
    batch_meta: list[tuple[int, int, int, int, int, torch.Tensor]],
    pool: CompressedPool,
    swa: SWASlots,
    layer: int,
    index: bool,
    kept: tuple[int, ...] = (),
) -> None:
    """Run one compressor for every sequence of a batch and store its new entries in the pool.

    ``batch_meta`` rows are (start, qlen, n0, slot, cached_until, block_table): entries that only
    cover positions below ``cached_until`` are already final in (possibly shared) blocks and are
    not rewritten (used by SWA-state replay). ``kept[i]``: sequence i's ring already holds exact
    state below that position (``ForwardBatch.kept_until``), which the step does not overwrite.
    """
    kv_all, gate_all = comp.kv_proj(x), comp.gate_proj(x)  # [T, C]
    ring_kv, ring_gate = swa.compressor_rings(layer, index)
    for i, (start, qlen, n0, slot, cached_until, table) in enumerate(batch_meta):
        keep_from = cached_until // comp.rate
        sl = slice(start, start + qlen)
        keep = kept[i] if kept else 0
        w0, entries = comp.step(rotary, kv_all[sl], gate_all[sl], n0, ring_kv, ring_gate, slot, keep)
        skip = max(0, keep_from - w0)  # entries already final in shared blocks are never rewritten
        if entries.shape[0] > skip:
            pool.write(layer, table, w0 + skip, entries[skip:], index=index)
