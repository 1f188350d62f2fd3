"""Prefill attention with bounded memory: each query attends to its own keys, in query chunks.

A prefill step's query at position ``p`` sees at most ``sliding_window`` raw keys (positions
``p - W + 1 .. p``) plus, in a compressed layer, the compressed entries complete at ``p``: every
one of them in an HCA layer, the indexer's ``index_topk`` in a CSA layer. Laying out every
query's keys as the decode path does (window first, in position order, then the compressed
entries) and attending with the decode path's `decode_attend` has three consequences:

* work and memory grow with ``queries x (W + entries seen)``, never with ``queries x
  (queries + W + all entries)`` as a dense causal mask over the whole step would;
* the step runs in chunks of queries whose workspace stays under `WORKSPACE_BYTES`, so a
  131,072-token prompt needs no more scratch memory than a 4,096-token one;
* a token's attention is the same computation in prefill, decode and verification: in the
  batch-invariant mode (one Triton program per query row) chunked prefill, unchunked
  prefill and decode agree bit for bit.

The CSA indexer scores entries in chunks too (`select_topk`): queries x entries tiles, with
a running top-k merged tile by tile. Equal scores resolve to the lowest entry index, as in
one sort over the whole row (`engine.model.compressor.topk_lowest_index`).

On CUDA outside the batch-invariant mode, `engine.kernels.prefill_attention` replaces the
gathered keys and their chunks: it reads every query's keys where they lie, given the
indexer's choices (`_choices`).
"""

from __future__ import annotations

import torch

from engine.kernels import batch_invariant
from engine.kernels import prefill_attention as kernel
from engine.model.compressor import Indexer, fused_index_scores, index_scores, topk_lowest_index
from engine.model.decode import decode_attend

#: scratch memory one query chunk may use for its keys, logits and probabilities; the
#: step's own activations come on top. 256 MiB keeps a flash-shape prefill chunk of 4,096
#: tokens (64 heads x 512 wide, 640 keys per query) in eight chunks of 512 queries.
WORKSPACE_BYTES = 256 << 20
#: elements of fp32 indexer scores one (queries x heads x entries) tile may hold (128 MiB)
INDEX_TILE_ELEMENTS = 32 << 20
#: the indexer scores at least this many queries per tile (fewer entries per tile instead):
#: a 131,072-token prompt's last steps score 32,768 entries per query
INDEX_MIN_QUERIES = 64
#: the same bound where the scores are fused (`compressor.fused_index_scores`): no per-head
#: products, so a tile is its scores and its running top-k's sort, ~32 bytes an element (the
#: scores, the candidates, the sort's values and int64 indices, the gathers): 256 MiB here
INDEX_FUSED_TILE_ELEMENTS = 8 << 20


def _index_tile(q: torch.Tensor, keys: torch.Tensor, heads: int) -> tuple[int, int]:
    """(elements an indexer tile may hold, elements per query and entry): every head's product
    where the scoring materialises them, the score alone where it is fused."""
    if fused_index_scores(q, keys):
        return INDEX_FUSED_TILE_ELEMENTS, 1
    return INDEX_TILE_ELEMENTS, heads


#: a CSA layer's indexer inputs for one sequence's step: (indexer, its queries [n, nI, dI],
#: head weights [n, nI] fp32, every entry's indexer key [E, dI])
IndexerInputs = tuple[Indexer, torch.Tensor, torch.Tensor, torch.Tensor]


def query_chunk(n_keys: int, heads: int, dim: int, elem: int, budget: int = WORKSPACE_BYTES) -> int:
    """Queries per chunk so that gathered keys ([c, n_keys, dim]) and three copies of the
    fp32-sized logits ([c, heads, n_keys]) fit in ``budget`` bytes; at least 1."""
    per_query = n_keys * dim * elem + 3 * heads * (n_keys + 1) * 4
    return max(1, budget // max(1, per_query))


def window_keys(
    raw: torch.Tensor,  # [W - 1 + n, hd]: positions n0 - W + 1 .. n0 + n - 1 (rows before ``first`` are junk)
    n0: int,
    start: int,
    count: int,
    window: int,
    first: int,  # lowest visible position (``lo``: what the ring holds, never below 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [count, W, hd] and visibility [count, W] of queries ``start .. start + count`` of
    the step (positions ``n0 + start ..``): key j of query i is position ``n0 + start + i - W + 1 + j``."""
    keys = raw[start : start + count + window - 1].unfold(0, window, 1).transpose(1, 2)  # [c, W, hd]
    qpos = torch.arange(n0 + start, n0 + start + count, device=raw.device)
    held = qpos[:, None] - (window - 1) + torch.arange(window, device=raw.device)[None, :]
    return keys, held >= first


def window_rows(ring_rows: torch.Tensor, new: torch.Tensor, window: int) -> torch.Tensor:
    """``ring_rows`` (positions ``lo .. n0 - 1`` read from the slot's ring, ``lo >= n0 - W + 1``)
    and ``new`` [n, hd] (positions ``n0 ..``) laid out from position ``n0 - W + 1``, zeros below
    ``lo``: the ``raw`` rows of `window_keys`."""
    lead = window - 1 - ring_rows.shape[0]
    pad = new.new_zeros(lead, new.shape[-1])
    return torch.cat([pad, ring_rows.to(new.dtype), new], dim=0)


def select_topk(
    ix: Indexer,
    q: torch.Tensor,  # [c, nI, dI] indexer queries
    w: torch.Tensor,  # [c, nI] head weights (fp32)
    keys: torch.Tensor,  # [E, dI] every entry's indexer key
    count: torch.Tensor,  # [c] entries complete at each query
    tile_elements: int | None = None,  # None: INDEX_TILE_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``index_topk`` entry ids [c, k] per query and their validity [c, k], scored in
    tiles of entries with a running top-k; the same ids as scoring the whole row at once."""
    c, heads, _ = q.shape
    e = keys.shape[0]
    k = min(ix.topk, e)
    budget, per = _index_tile(q, keys, heads)
    tile = max(1, (tile_elements or budget) // max(1, c * per))
    best_s = q.new_empty(c, 0, dtype=torch.float32)
    best_i = torch.empty(c, 0, dtype=torch.long, device=q.device)
    for lo in range(0, e, tile):
        hi = min(e, lo + tile)
        s = index_scores(ix, q, w, keys[lo:hi])  # [c, tile]
        ids = torch.arange(lo, hi, device=q.device)
        s = s.masked_fill(ids[None, :] >= count[:, None], float("-inf"))
        # running entries first: they all have lower ids, so a stable sort keeps ties lowest-first
        cand_s = torch.cat([best_s, s], dim=1)
        cand_i = torch.cat([best_i, ids[None, :].expand(c, -1)], dim=1)
        order = topk_lowest_index(cand_s, k)
        best_s, best_i = cand_s.gather(1, order), cand_i.gather(1, order)
    return best_i, best_i < count[:, None]


def attend_sequence(
    q: torch.Tensor,  # [n, H, hd] rotated queries of this sequence's new tokens
    raw: torch.Tensor,  # window_rows(...) [W - 1 + n, hd]
    n0: int,
    first: int,  # lowest visible raw position (``lo`` of `window_rows`)
    window: int,
    sinks: torch.Tensor,  # [H]
    compressed: tuple[torch.Tensor, int] | None = None,  # (this sequence's entries [E, hd], rate)
    csa: IndexerInputs | None = None,
    workspace: int | None = None,  # bytes (None: WORKSPACE_BYTES)
    out: torch.Tensor | None = None,  # [n, H, hd]: written in place (the step's rows of this sequence)
) -> torch.Tensor:
    """Attention output [n, H, hd] of one sequence's prefill queries, in bounded query
    chunks; in ``out`` when given."""
    n, heads, hd = q.shape
    entries, rate = compressed if compressed is not None else (None, 1)
    e_all = 0 if entries is None else entries.shape[0]
    if kernel.usable(q) and not batch_invariant.enabled():  # keys read in place, no chunks
        idx = _choices(csa, n0, n, rate, e_all) if csa is not None and e_all else None
        return kernel.prefill_attention(
            q, raw, n0, first - n0 + window - 1, window, sinks, entries, rate, idx, out
        )
    out = torch.empty_like(q) if out is None else out
    seen = min(e_all, csa[0].topk) if csa is not None else e_all
    chunk = query_chunk(
        window + seen, heads, hd, q.element_size(), WORKSPACE_BYTES if workspace is None else workspace
    )
    for s in range(0, n, chunk):
        c = min(chunk, n - s)
        keys, visible = window_keys(raw, n0, s, c, window, first)
        if entries is not None:
            count = torch.arange(n0 + s + 1, n0 + s + c + 1, device=q.device) // rate  # [c] complete
            e_max = min(e_all, (n0 + s + c) // rate)
            if e_max > 0:
                if csa is not None:
                    ix, iq, iw, ikeys = csa
                    top, cvis = select_topk(ix, iq[s : s + c], iw[s : s + c], ikeys[:e_max], count)
                    comp = entries[top]  # [c, k, hd]
                else:
                    comp = entries[:e_max].unsqueeze(0).expand(c, -1, -1)
                    cvis = torch.arange(e_max, device=q.device)[None, :] < count[:, None]
                keys = torch.cat([keys, comp.to(keys.dtype)], dim=1)
                visible = torch.cat([visible, cvis], dim=1)
        out[s : s + c] = decode_attend(q[s : s + c], keys.contiguous(), visible, sinks)
    return out


def _choices(csa: IndexerInputs, n0: int, n: int, rate: int, e_all: int) -> torch.Tensor:
    """The indexer's entry ids [n, k] for every query of the step, -1 where none: in query
    chunks whose (queries x heads x entries) scores fit one `INDEX_TILE_ELEMENTS` tile, or
    `INDEX_MIN_QUERIES` queries over several tiles of entries."""
    ix, iq, iw, ikeys = csa
    heads = iq.shape[1]
    budget, per = _index_tile(iq, ikeys, heads)
    chunk = min(n, max(INDEX_MIN_QUERIES, budget // max(1, per * e_all)))
    parts = []
    for s in range(0, n, chunk):
        c = min(chunk, n - s)
        count = torch.arange(n0 + s + 1, n0 + s + c + 1, device=iq.device) // rate
        e_max = min(e_all, (n0 + s + c) // rate)
        if e_max == 0:
            parts.append(torch.full((c, min(ix.topk, e_all)), -1, dtype=torch.long, device=iq.device))
            continue
        top, valid = select_topk(ix, iq[s : s + c], iw[s : s + c], ikeys[:e_max], count)
        top = torch.where(valid, top, -1)
        width = min(ix.topk, e_all)
        if top.shape[1] < width:
            top = torch.cat([top, top.new_full((c, width - top.shape[1]), -1)], dim=1)
        parts.append(top)
    return torch.cat(parts)
