"""Vectorised decode path: every sequence of the batch brings exactly one token.

No per-sequence Python loop: ring slots, block tables and positions are gathered as tensors,
so a decode step costs a fixed number of kernels per layer whatever the batch size. Results
equal the general per-sequence path (tests/unit/engine/test_decode_path.py).
"""

from __future__ import annotations

import torch

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.forward_batch import ForwardBatch, upload
from engine.kernels import batch_invariant
from engine.model.compressor import Compressor, Indexer, index_scores, topk_lowest_index
from engine.model.rope import Rotary


def _seq_tensor(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=torch.long), like.device)


def take_rows(store: torch.Tensor, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """``store[outer, inner]`` for a ``[N, R, ...]`` store (ring slots x rows, pool blocks x
    rows) and non-negative index tensors that broadcast to one shape ``S``: ``[*S, ...]``, the
    same values. Taken as whole rows by one ``index_select`` over the store's first two
    dimensions flattened: advanced indexing on two dimensions runs an element-wise gather
    kernel, which took 7.5 ms of an H100 verification step's device time where whole rows
    take 3.8 (docs/benchmarks.md, "Rows taken whole")."""
    if not store.is_contiguous():  # flattening would copy the whole store
        return store[outer, inner]
    flat = outer * store.shape[1] + inner
    rows = store.flatten(0, 1).index_select(0, flat.reshape(-1))
    return rows.view(*flat.shape, *store.shape[2:])


def written(batch: ForwardBatch, layer: int) -> torch.Tensor | None:
    """[B] bool: whose ring rows of ``layer`` this step writes; None: every sequence's (the
    common case). False for a position a kept host-slot layer already holds (swa_keep)."""
    if not batch.any_kept(layer):
        return None
    rows = [p >= until for p, until in zip(batch.num_computed_cpu, batch.kept_until(layer))]
    return upload(torch.tensor(rows, dtype=torch.bool), batch.positions.device)


def decode_compress(
    comp: Compressor,
    rotary: Rotary,
    x: torch.Tensor,  # [B, hidden]
    batch: ForwardBatch,
    pool: CompressedPool,
    swa: SWASlots,
    layer: int,
    index: bool,
) -> None:
    """Append each sequence's projections to its ring; emit the entries of windows that close now."""
    m = comp.rate
    ring_kv, ring_gate = swa.compressor_rings(layer, index)
    r = ring_kv.shape[1]
    slots, pos = batch.swa_slot, batch.positions
    live = written(batch, layer)
    if batch.padded is not None:  # fixed shapes: every row pools; rows not closing go to scratch
        ring_kv[slots, pos % r] = comp.kv_proj(x).to(ring_kv.dtype)
        ring_gate[slots, pos % r] = comp.gate_proj(x).to(ring_gate.dtype)
        offs = closing_offsets(comp, pos)
        kv, gate = ring_kv[slots[:, None], offs % r], ring_gate[slots[:, None], offs % r]
        closes = (pos + 1) % m == 0
        store_entries(
            comp, rotary, kv, gate, offs, pos, batch.block_table, pool, layer, index,
            (closes, batch.padded.scratch_block),
        )  # fmt: skip
        return
    if live is None:
        ring_kv[slots, pos % r] = comp.kv_proj(x).to(ring_kv.dtype)
        ring_gate[slots, pos % r] = comp.gate_proj(x).to(ring_gate.dtype)
    else:
        ring_kv[slots[live], pos[live] % r] = comp.kv_proj(x[live]).to(ring_kv.dtype)
        ring_gate[slots[live], pos[live] % r] = comp.gate_proj(x[live]).to(ring_gate.dtype)
    closing = [
        i
        for i, (p, keep) in enumerate(zip(batch.num_computed_cpu, batch.cached_until))
        if (p + 1) % m == 0 and (p + 1) // m - 1 >= keep // m
    ]
    if not closing:
        return
    sel = _seq_tensor(tuple(closing), pos)
    p, s = pos[sel], slots[sel]  # [n]
    offs = closing_offsets(comp, p)
    kv = ring_kv[s[:, None], offs % r]  # [n, span, C]
    gate = ring_gate[s[:, None], offs % r]
    store_entries(comp, rotary, kv, gate, offs, p, batch.block_table[sel], pool, layer, index)


def closing_offsets(comp: Compressor, closing: torch.Tensor) -> torch.Tensor:
    """[n, span] positions an entry closing at each of ``closing`` [n] pools."""
    span = 2 * comp.rate if comp.overlap else comp.rate
    return closing[:, None] + 1 - span + torch.arange(span, device=closing.device)[None, :]


def store_entries(
    comp: Compressor,
    rotary: Rotary,
    kv: torch.Tensor,  # [n, span, C] projected kv at ``offs``
    gate: torch.Tensor,  # [n, span, C] projected gates there (before position_bias)
    offs: torch.Tensor,  # [n, span] their positions (closing_offsets)
    closing: torch.Tensor,  # [n] the position closing each entry
    tables: torch.Tensor,  # [n, max_blocks] each entry's sequence's block table
    pool: CompressedPool,
    layer: int,
    index: bool,
    only: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Pool each closing window into its entry (softmax-gated, with the overlapping previous
    window's Ca half for CSA), normalise, rotate and store it in the pool. ``only`` = (closes
    [n] bool, scratch block): rows whose window does not close write to the scratch block."""
    m, d = comp.rate, comp.dim
    gate = gate + (comp.position_bias.repeat(2, 1) if comp.overlap else comp.position_bias)
    if comp.overlap:  # previous window's Ca half, then this window's Cb half
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
        gate[:, :m] = gate[:, :m].masked_fill((offs[:, :m] < 0).unsqueeze(-1), float("-inf"))
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [n, d]
    entries = rotary(comp.kv_norm(pooled), closing + 1 - m)
    store = pool.index_rows[layer] if index else pool.rows[layer]
    rpb = store.shape[1]
    w = (closing + 1) // m - 1
    if only is None:
        blocks = tables.gather(1, (w // rpb)[:, None]).squeeze(1)
    else:
        closes, scratch = only
        w = w.clamp(min=0)
        blocks = tables.gather(1, (w // rpb).clamp(max=tables.shape[1] - 1)[:, None]).squeeze(1)
        blocks = torch.where(closes & (blocks >= 0), blocks, scratch)
    store[blocks, w % rpb] = entries.to(store.dtype)


def _gather_entries(store: torch.Tensor, table: torch.Tensor, e_max: int) -> torch.Tensor:
    """Entries [0, e_max) of every sequence: [B, e_max, dim] (rows past a sequence's count are junk)."""
    rpb = store.shape[1]
    e = torch.arange(e_max, device=table.device)
    return take_rows(store, table[:, e // rpb].clamp(min=0), (e % rpb)[None, :])


def _csa_select(
    ix: Indexer, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k entry ids [B, k] and their validity [B, k], from indexer queries [B, nI, dI],
    head weights [B, nI] and every entry's indexer key [B, E, dI]."""
    e_max = ikeys.shape[1]
    scores = index_scores(ix, iq, iw, ikeys)  # [B, E]
    ent = torch.arange(e_max, device=iq.device)[None, :]
    scores = scores.masked_fill(ent >= count[:, None], float("-inf"))
    top = topk_lowest_index(scores, ix.topk)  # [B, k]
    return top, top < count[:, None]


def decode_keys(
    kv: torch.Tensor,  # [B, hd] this step's keys (rotated)
    batch: ForwardBatch,
    window_ring: torch.Tensor,
    compressed: tuple[torch.Tensor, int] | None,  # (pool rows of this layer, rate)
    csa: tuple[Indexer, torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (indexer, iq, iw, index rows)
    live: torch.Tensor | None = None,  # [B] bool: whose ring row this step writes (None: all)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [B, K, hd] and visibility [B, K] for one decode token per sequence; writes the window ring."""
    w = window_ring.shape[1]
    slots, pos = batch.swa_slot, batch.positions
    if live is None:
        window_ring[slots, pos % w] = kv.to(window_ring.dtype)
    else:  # a kept layer's ring already holds this position's exact key: attend to that one
        window_ring[slots[live], pos[live] % w] = kv[live].to(window_ring.dtype)
    # keys in position order, pos - W + 1 .. pos (ring row p % W holds position p), as the
    # verification path lays them out: a token's attention sums in the same order either way
    held = pos[:, None] - (w - 1) + torch.arange(w, device=pos.device)[None, :]  # [B, W]
    keys = take_rows(window_ring, slots[:, None], held % w)  # [B, W, hd]
    if batch.padded is not None:
        visible = held >= batch.padded.window_from[:, None]
    elif any(batch.window_from):
        visible = held >= _seq_tensor(batch.window_from, pos)[:, None]
    else:
        visible = held >= 0  # rows never written hold negative positions
    if compressed is None:
        return keys, visible
    rows, rate = compressed
    count = (pos + 1) // rate  # [B] complete entries
    if batch.padded is not None:  # a fixed shape: entries past a row's count are masked
        e_max = batch.padded.context // rate
    else:
        e_max = max((p + 1) // rate for p in batch.num_computed_cpu)
    if e_max == 0:
        return keys, visible
    if csa is not None:  # attend to the k selected entries only: gather them, not all E
        ix, iq, iw, irows = csa
        top, cvis = _csa_select(ix, iq, iw, _gather_entries(irows, batch.block_table, e_max), count)
        rpb = rows.shape[1]
        blocks = batch.block_table.gather(1, top // rpb).clamp(min=0)
        comp = take_rows(rows, blocks, top % rpb)  # [B, k, hd]
    else:
        comp = _gather_entries(rows, batch.block_table, e_max)  # [B, E, hd]
        cvis = torch.arange(e_max, device=pos.device)[None, :] < count[:, None]
    return torch.cat([keys, comp.to(keys.dtype)], dim=1), torch.cat([visible, cvis], dim=1)


def decode_attend(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [B, H, hd], keys [B, K, hd] (also values), visible [B, K] -> [B, H, hd]."""
    if batch_invariant.applies(q):
        return batch_invariant.attend(q, keys, visible, sinks)
    logits = torch.einsum("bhd,bkd->bhk", q, keys) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    comb = torch.cat([logits, sink], dim=-1)
    comb = comb - comb.max(dim=-1, keepdim=True).values
    probs = torch.softmax(comb, dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)
