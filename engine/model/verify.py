"""Vectorised path for steps of a few tokens per sequence (speculative verification).

Every sequence brings 1 to ``MAX_QUERY`` tokens (the input token and its drafts) at
positions ``n0 .. n0 + q - 1``; nothing is replayed (no ``rows_cached_until``, no kept
host-slot layers, no image rows). Like `engine.model.decode`, a step costs a fixed number
of kernels per layer whatever the batch, where the general path loops over sequences.

Tokens stay flat (``[T]``, each knowing its sequence and its sequence's first token:
`Layout`), and every layer reads the same index tensors, made once a step
(`ForwardBatch.memo`). Each step reads the slot's rings **before** writing any of its own
positions (a write at ``n0 + j`` lands on the row of ``n0 + j - R``, which an earlier token
of the same step may still need), then writes them:

* **window**: a token at ``p`` sees the ring's old rows holding positions in
  ``(p - W, n0)`` and the step's own keys at ``n0 .. p``;
* **compressors**: an entry closing at ``c`` in the step pools positions
  ``c + 1 - span .. c`` taken from the old ring (below ``n0``) or the step's projections;
  entries are written to the pool before attention, so a later token of the step sees
  them, as in the per-sequence path;
* **compressed keys**: each token reads its sequence's entries complete at its position
  (CSA: the indexer's top-k for that token), through its sequence's block table.

Results equal the general path (`tests/unit/engine/test_verify_path.py`).

A CUDA graph's padded batch (``batch.padded``, `engine.cuda_graphs`) names each token's row
and each row's first token and own token count in static tensors; tokens that are no row's
own are padding, which write the scratch slot and block only
(`engine.forward_batch.PaddedDecode`). Its shapes come from the padding, never from the
values: each row pools the most windows that can close among ``Q`` tokens (those that do
not close go to the scratch block) and attention gathers the context bucket's entries.
"""

from __future__ import annotations

import torch

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.forward_batch import ForwardBatch, PaddedDecode, upload
from engine.kernels import batch_invariant
from engine.model.compressor import Compressor, Indexer
from engine.model.decode import (
    EntryWrites,
    _csa_select,
    closing_offsets,
    entry_rows,
    store_entries,
    take_flat,
    take_rows,
)
from engine.model.rope import Rotary

MAX_QUERY = 8  # tokens per sequence up to which a step takes this path


def applies(batch: ForwardBatch) -> bool:
    """Whether ``batch`` takes this path (several tokens per sequence, none replayed). In the
    batch-invariant mode, only decode and verification rows (logits at every token): a short
    prompt chunk takes the general path whatever shares its step."""
    if not (
        max(batch.query_len_cpu) <= MAX_QUERY
        and not any(batch.cached_until)
        and not batch.swa_keep_cpu
        and not batch.embeds
    ):
        return False
    if not batch_invariant.enabled():
        return True
    logits = batch.num_logits_cpu or (1,) * batch.num_seqs
    return all(q == 1 or n == q for q, n in zip(batch.query_len_cpu, logits))


class Layout:
    """Where each flat token sits among its sequence's (built once per step)."""

    def __init__(self, batch: ForwardBatch) -> None:
        dev = batch.positions.device
        self.q = max(batch.query_len_cpu)
        self.n0 = batch.num_computed  # [B]
        self.slots = batch.swa_slot  # [B]
        self.pos = batch.positions  # [T]
        # [T] the slot each token's ring rows are written to (None: its sequence's)
        self.write_slots: torch.Tensor | None = None
        padded = batch.padded
        if padded is not None:  # the graph's static tensors: no host data (a graph's replays)
            assert padded.seq is not None and padded.start is not None
            self.q = padded.query
            self.seq, self.start = padded.seq, padded.start
            self.window_from = padded.window_from
            self.write_slots = padded.write_slot
            return
        seq = [i for i, n in enumerate(batch.query_len_cpu) for _ in range(n)]
        self.seq = upload(torch.tensor(seq, dtype=torch.long), dev)  # [T] sequence of each token
        self.start = batch.query_start  # [B] each sequence's first flat token
        self.window_from = upload(torch.tensor(batch.window_from, dtype=torch.long), dev)  # [B]

    def write(self, batch: ForwardBatch, ring: torch.Tensor, values: torch.Tensor) -> None:
        """Store each token's row [T, C] at its position (after every read of the step)."""

        def index() -> tuple[torch.Tensor, torch.Tensor]:
            slots = self.slots[self.seq] if self.write_slots is None else self.write_slots
            return slots, self.pos % ring.shape[1]

        ring[batch.memo(("verify ring write", ring.shape[1]), index)] = values.to(ring.dtype)


def _taken(
    ring: torch.Tensor, ring_rows: torch.Tensor, own: torch.Tensor, step: torch.Tensor, fresh: torch.Tensor
) -> torch.Tensor:
    """Rows ``[*S, C]`` each read from the ring before the step (``ring_rows``: flat indices
    into its ``[slots x rows]``) or from the step's own rows ``step`` [T, C] (``own``: flat
    token indices) where ``fresh`` [*S] holds: the same values as indexing either, each
    taken whole by one ``index_select`` (`engine.model.decode.take_rows`)."""
    old = take_flat(ring, ring_rows)
    new = step.to(ring.dtype).index_select(0, own.reshape(-1)).view(*own.shape, -1)
    return torch.where(fresh[..., None], new, old)


def verify_compress(
    comp: Compressor,
    rotary: Rotary,
    x: torch.Tensor,  # [T, hidden]
    lay: Layout,
    batch: ForwardBatch,
    pool: CompressedPool,
    swa: SWASlots,
    layer: int,
    index: bool,
) -> None:
    """Emit the entries of windows closing in the step into the pool; update the ring."""
    ring_kv, ring_gate = swa.compressor_rings(layer, index)
    kv_new, gate_new = comp.kv_proj(x), comp.gate_proj(x)  # [T, C]
    r = ring_kv.shape[1]
    at = batch.memo(
        ("verify closings", comp.rate, comp.overlap, r), lambda: _VerifyClosings(comp, lay, batch, r)
    )
    if at.seq.numel():
        kv = _taken(ring_kv, at.ring_rows, at.own, kv_new, at.fresh)  # [n, span, C]
        gate = _taken(ring_gate, at.ring_rows, at.own, gate_new, at.fresh)
        store_entries(comp, rotary, kv, gate, at.writes, pool, layer, index)
    lay.write(batch, ring_kv, kv_new)
    lay.write(batch, ring_gate, gate_new)


class _VerifyClosings:
    """The entries a compressor of one rate closes in the step, and where the rows each pools
    come from (one per rate and ring size a step: every layer's compressor reads them)."""

    def __init__(self, comp: Compressor, lay: Layout, batch: ForwardBatch, r: int) -> None:
        m = comp.rate
        only = None
        if batch.padded is None:
            closing = ((lay.pos + 1) % m == 0).nonzero().flatten()
            self.seq, c = lay.seq[closing], lay.pos[closing]  # [n] each entry's sequence, position
        else:  # fixed shapes: each row pools the windows that can close among its Q tokens
            self.seq, c, closes = _padded_closings(lay, batch.padded, m)
            only = (closes, batch.padded.scratch_block)
        offs = closing_offsets(comp, c)  # [n, span]
        n0 = lay.n0[self.seq][:, None]
        self.fresh = offs >= n0  # the step's own projections; the others are in the ring
        self.ring_rows = lay.slots[self.seq][:, None] * r + offs % r
        self.own = lay.start[self.seq][:, None] + (offs - n0).clamp(min=0)
        self.writes = EntryWrites(comp, offs, c, batch.block_table[self.seq], only)


def _padded_closings(
    lay: Layout, padded: PaddedDecode, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded batch's candidate entries: for each row, the ``(Q - 1) // m + 1`` positions
    ``n0 + ((m - 1 - n0) mod m) + j m`` (the most windows that can close among ``Q`` tokens),
    clamped to the row's last token: (row [n], position [n], whether it closes a window at one
    of the row's own tokens [n]). The shapes depend on ``Q`` and ``m`` only; entries that do
    not close go to the scratch block. Before, every token pooled a window: ``Q`` times the
    pooling of the long-window layers, whose rate (128) closes at most one window a step."""
    assert padded.qlen is not None
    rows = lay.n0.shape[0]
    k = (lay.q - 1) // m + 1
    seq = torch.arange(rows, device=lay.n0.device).repeat_interleave(k)  # [B k]
    n0, own = lay.n0[seq], padded.qlen[seq]
    col = (m - 1 - n0) % m + m * torch.arange(k, device=n0.device).repeat(rows)
    return seq, n0 + torch.minimum(col, (own - 1).clamp(min=0)), col < own


class _Window:
    """Where each token's window keys come from, and which it sees (one per window size a step)."""

    def __init__(self, lay: Layout, w: int, window: int) -> None:
        s, p = lay.seq, lay.pos[:, None]
        held = p - (w - 1) + torch.arange(w, device=p.device)[None, :]  # [T, W] positions
        n0 = lay.n0[s][:, None]
        self.fresh = held >= n0  # the step's own keys; the others are in the ring (read before it writes)
        self.ring_rows = lay.slots[s][:, None] * w + held % w
        self.own = lay.start[s][:, None] + (held - n0).clamp(min=0)
        self.visible = (held >= 0) & (held >= lay.window_from[s][:, None]) & (held > p - window)


class _Entries:
    """Each token's compressed entries of one rate: how many are complete at its position, the
    fixed count gathered, and (all entries gathered) their pool rows and visibility."""

    def __init__(self, lay: Layout, batch: ForwardBatch, rate: int, rpb: int, gather_all: bool) -> None:
        self.count = (lay.pos + 1) // rate  # [T] entries complete at each token
        if batch.padded is not None:  # a fixed shape: entries past a token's count are masked
            self.e_max = batch.padded.context // rate
        else:
            self.e_max = max(n0 + q for n0, q in zip(batch.num_computed_cpu, batch.query_len_cpu)) // rate
        self.table = batch.block_table[lay.seq]  # [T, nb]
        if self.e_max and gather_all:
            self.rows = entry_rows(self.table, self.e_max, rpb)  # [T, E] flat pool rows
            ent = torch.arange(self.e_max, device=lay.pos.device)[None, :]
            self.visible = ent < self.count[:, None]


def verify_keys(
    kv: torch.Tensor,  # [T, hd] this step's keys (rotated)
    lay: Layout,
    batch: ForwardBatch,
    window_ring: torch.Tensor,
    window: int,
    compressed: tuple[torch.Tensor, int] | None,  # (pool rows of this layer, rate)
    csa: tuple[Indexer, torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (indexer, iq, iw, index rows)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, K, hd] and visibility [T, K] of every token; writes the window ring.

    A token at ``p`` gets its window in position order, ``p - W + 1 .. p``, as the decode path
    lays it out (`engine.model.decode.decode_keys`): positions below ``n0`` from the ring
    (read before this step writes it), the others from the step's own keys."""
    w = window_ring.shape[1]
    win = batch.memo(("verify window", w, window), lambda: _Window(lay, w, window))
    keys = _taken(window_ring, win.ring_rows, win.own, kv, win.fresh)  # [T, W, hd]
    lay.write(batch, window_ring, kv)
    if compressed is None:
        return keys, win.visible
    rows, rate = compressed
    rpb = rows.shape[1]
    ent = batch.memo(
        ("verify entries", rate, rpb, csa is None), lambda: _Entries(lay, batch, rate, rpb, csa is None)
    )
    if ent.e_max == 0:
        return keys, win.visible
    if csa is not None:
        ix, iq, iw, irows = csa
        irpb = irows.shape[1]
        at = batch.memo(("verify index rows", rate, irpb), lambda: entry_rows(ent.table, ent.e_max, irpb))
        ikeys = take_flat(irows, at)
        top, cvis = _csa_select(ix, iq, iw, ikeys, ent.count)
        comp = take_rows(rows, ent.table.gather(1, top // rpb).clamp(min=0), top % rpb)  # [T, k, hd]
    else:
        comp, cvis = take_flat(rows, ent.rows), ent.visible  # [T, E, hd]
    return torch.cat([keys, comp.to(keys.dtype)], dim=1), torch.cat([win.visible, cvis], dim=1)
