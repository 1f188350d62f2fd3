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
    return take_flat(store, outer * store.shape[1] + inner)


def take_flat(store: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """`take_rows` with the flat row indices ``outer * R + inner`` already made: ``[*S, ...]``."""
    rows = store.flatten(0, 1).index_select(0, flat.reshape(-1))
    return rows.view(*flat.shape, *store.shape[2:])


def entry_rows(table: torch.Tensor, e_max: int, rpb: int) -> torch.Tensor:
    """Flat pool rows ``[N, e_max]`` of entries ``0 .. e_max - 1`` of every row's block table
    ``[N, nb]`` (pool blocks of ``rpb`` rows; rows past a sequence's entries are junk)."""
    e = torch.arange(e_max, device=table.device)
    return table[:, e // rpb].clamp(min=0) * rpb + (e % rpb)[None, :]


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
        at = batch.memo(
            ("decode closings", m, comp.overlap, r), lambda: _PaddedDecodeClosings(comp, batch, r)
        )
        ring_kv[slots, at.row] = comp.kv_proj(x).to(ring_kv.dtype)
        ring_gate[slots, at.row] = comp.gate_proj(x).to(ring_gate.dtype)
        kv, gate = take_flat(ring_kv, at.ring_rows), take_flat(ring_gate, at.ring_rows)
        store_entries(comp, rotary, kv, gate, at.writes, pool, layer, index)
        return
    if live is None:
        ring_kv[slots, pos % r] = comp.kv_proj(x).to(ring_kv.dtype)
        ring_gate[slots, pos % r] = comp.gate_proj(x).to(ring_gate.dtype)
    else:
        ring_kv[slots[live], pos[live] % r] = comp.kv_proj(x[live]).to(ring_kv.dtype)
        ring_gate[slots[live], pos[live] % r] = comp.gate_proj(x[live]).to(ring_gate.dtype)
    shut = batch.memo(("decode closing rows", m, comp.overlap, r), lambda: _DecodeClosings(comp, batch, r))
    if shut.writes is None:
        return
    kv = take_flat(ring_kv, shut.ring_rows)  # [n, span, C]
    gate = take_flat(ring_gate, shut.ring_rows)
    store_entries(comp, rotary, kv, gate, shut.writes, pool, layer, index)


class _DecodeClosings:
    """The rows of a decode batch whose position closes a window of one rate (not one a prefix
    hit already holds): the ring rows each entry pools and where it is written (every layer
    of that rate reads them); ``writes`` None where no row closes one."""

    def __init__(self, comp: Compressor, batch: ForwardBatch, r: int) -> None:
        m = comp.rate
        closing = [
            i
            for i, (p, keep) in enumerate(zip(batch.num_computed_cpu, batch.cached_until))
            if (p + 1) % m == 0 and (p + 1) // m - 1 >= keep // m
        ]
        self.writes: EntryWrites | None = None
        if not closing:
            return
        sel = _seq_tensor(tuple(closing), batch.positions)
        p, s = batch.positions[sel], batch.swa_slot[sel]  # [n]
        offs = closing_offsets(comp, p)
        self.ring_rows = s[:, None] * r + offs % r
        self.writes = EntryWrites(comp, offs, p, batch.block_table[sel])


class _PaddedDecodeClosings:
    """A padded decode batch's compressor rows of one rate (every layer of that rate reads
    them): each row's ring row, the window an entry closing at its position pools, and
    whether it closes one."""

    def __init__(self, comp: Compressor, batch: ForwardBatch, r: int) -> None:
        assert batch.padded is not None
        slots, pos = batch.swa_slot, batch.positions
        self.row = pos % r
        offs = closing_offsets(comp, pos)  # [B, span]
        self.ring_rows = slots[:, None] * r + offs % r
        only = ((pos + 1) % comp.rate == 0, batch.padded.scratch_block)
        self.writes = EntryWrites(comp, offs, pos, batch.block_table, only)


def closing_offsets(comp: Compressor, closing: torch.Tensor) -> torch.Tensor:
    """[n, span] positions an entry closing at each of ``closing`` [n] pools."""
    span = 2 * comp.rate if comp.overlap else comp.rate
    return closing[:, None] + 1 - span + torch.arange(span, device=closing.device)[None, :]


class EntryWrites:
    """Where the entries closing at ``closing`` [n] go, and what pooling them needs besides the
    rows: the positions they are rotated at, the mask of window rows before position 0
    (overlapping windows), and their pool rows. ``tables`` [n, max_blocks]: each entry's
    sequence's block table; ``only`` = (closes [n] bool, scratch block): entries whose window
    does not close are written to the scratch block. Made once per rate a step; every layer
    of that rate pools with it."""

    def __init__(
        self,
        comp: Compressor,
        offs: torch.Tensor,  # [n, span] the positions each entry pools (closing_offsets)
        closing: torch.Tensor,
        tables: torch.Tensor,
        only: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        m = comp.rate
        self.positions = closing + 1 - m  # one tensor: every layer's rotary finds its cos/sin
        self.before_start = (offs[:, :m] < 0).unsqueeze(-1) if comp.overlap else None
        w = (closing + 1) // m - 1  # each entry's index in its sequence
        if only is not None:
            w = w.clamp(min=0)
        self._w, self._tables, self._only = w, tables, only
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, rpb: int) -> torch.Tensor:
        """[n] flat rows of a pool of ``rpb`` rows a block."""
        if rpb not in self._rows:
            w, tables = self._w, self._tables
            if self._only is None:
                blocks = tables.gather(1, (w // rpb)[:, None]).squeeze(1)
            else:
                closes, scratch = self._only
                blocks = tables.gather(1, (w // rpb).clamp(max=tables.shape[1] - 1)[:, None]).squeeze(1)
                blocks = torch.where(closes & (blocks >= 0), blocks, scratch)
            self._rows[rpb] = blocks * rpb + w % rpb
        return self._rows[rpb]


def store_entries(
    comp: Compressor,
    rotary: Rotary,
    kv: torch.Tensor,  # [n, span, C] projected kv at the positions each entry pools
    gate: torch.Tensor,  # [n, span, C] projected gates there (before position_bias)
    at: EntryWrites,
    pool: CompressedPool,
    layer: int,
    index: bool,
) -> None:
    """Pool each closing window into its entry (softmax-gated, with the overlapping previous
    window's Ca half for CSA), normalise, rotate and store it in the pool."""
    m, d = comp.rate, comp.dim
    gate = gate + (comp.position_bias.repeat(2, 1) if comp.overlap else comp.position_bias)
    if at.before_start is not None:  # previous window's Ca half, then this window's Cb half
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
        gate[:, :m] = gate[:, :m].masked_fill(at.before_start, float("-inf"))
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [n, d]
    entries = rotary(comp.kv_norm(pooled), at.positions)
    store = pool.index_rows[layer] if index else pool.rows[layer]
    store.view(-1, store.shape[-1])[at.rows(store.shape[1])] = entries.to(store.dtype)


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
    win = batch.memo(("decode window", w), lambda: _DecodeWindow(batch, w))
    keys = take_flat(window_ring, win.ring_rows)  # [B, W, hd]
    if compressed is None:
        return keys, win.visible
    rows, rate = compressed
    ent = batch.memo(
        ("decode entries", rate, rows.shape[1], csa is None),
        lambda: _DecodeEntries(batch, rate, rows.shape[1], csa is None),
    )
    if ent.e_max == 0:
        return keys, win.visible
    if csa is not None:  # attend to the k selected entries only: gather them, not all E
        ix, iq, iw, irows = csa
        irpb = irows.shape[1]
        at = batch.memo(
            ("decode index rows", rate, irpb), lambda: entry_rows(batch.block_table, ent.e_max, irpb)
        )
        top, cvis = _csa_select(ix, iq, iw, take_flat(irows, at), ent.count)
        rpb = rows.shape[1]
        blocks = batch.block_table.gather(1, top // rpb).clamp(min=0)
        comp = take_rows(rows, blocks, top % rpb)  # [B, k, hd]
    else:
        comp, cvis = take_flat(rows, ent.rows), ent.visible  # [B, E, hd]
    return torch.cat([keys, comp.to(keys.dtype)], dim=1), torch.cat([win.visible, cvis], dim=1)


class _DecodeWindow:
    """Each row's window keys in position order, ``pos - W + 1 .. pos`` (ring row ``p % W``
    holds position ``p``), as the verification path lays them out, so that a token's attention
    sums in the same order either way; and which of them it sees."""

    def __init__(self, batch: ForwardBatch, w: int) -> None:
        slots, pos = batch.swa_slot, batch.positions
        held = pos[:, None] - (w - 1) + torch.arange(w, device=pos.device)[None, :]  # [B, W]
        self.ring_rows = slots[:, None] * w + held % w
        if batch.padded is not None:
            self.visible = held >= batch.padded.window_from[:, None]
        elif any(batch.window_from):
            self.visible = held >= _seq_tensor(batch.window_from, pos)[:, None]
        else:
            self.visible = held >= 0  # rows never written hold negative positions


class _DecodeEntries:
    """Each row's compressed entries of one rate: how many are complete, the fixed count
    gathered, and (all entries gathered) their flat pool rows and visibility."""

    def __init__(self, batch: ForwardBatch, rate: int, rpb: int, gather_all: bool) -> None:
        pos = batch.positions
        self.count = (pos + 1) // rate  # [B] complete entries
        if batch.padded is not None:  # a fixed shape: entries past a row's count are masked
            self.e_max = batch.padded.context // rate
        else:
            self.e_max = max((p + 1) // rate for p in batch.num_computed_cpu)
        if self.e_max and gather_all:
            self.rows = entry_rows(batch.block_table, self.e_max, rpb)  # [B, E]
            self.visible = torch.arange(self.e_max, device=pos.device)[None, :] < self.count[:, None]


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
