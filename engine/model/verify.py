"""Vectorised path for steps of a few tokens per sequence (speculative verification).

Every sequence brings 1 to ``MAX_QUERY`` tokens (the input token and its drafts) at
positions ``n0 .. n0 + q - 1``; nothing is replayed (no ``rows_cached_until``, no kept
host-slot layers, no image rows). Like `engine.model.decode`, a step costs a fixed number
of kernels per layer whatever the batch, where the general path loops over sequences.

Sequences are padded to ``Q = max q``: ``[B, Q]``. Each step reads the slot's rings
**before** writing any of its own positions (a write at ``n0 + j`` lands on the row of
``n0 + j - R``, which an earlier token of the same step may still need), then writes them:

* **window**: a token at ``p`` sees the ring's old rows holding positions in
  ``(p - W, n0)`` and the step's own keys at ``n0 .. p``;
* **compressors**: an entry closing at ``c`` in the step pools positions
  ``c + 1 - span .. c`` taken from the old ring (below ``n0``) or the step's projections;
  entries are written to the pool before attention, so a later token of the step sees
  them, as in the per-sequence path;
* **compressed keys**: each token reads its sequence's entries complete at its position
  (CSA: the indexer's top-k for that token), through its sequence's block table.

Results equal the general path (`tests/unit/engine/test_verify_path.py`).

A CUDA graph's padded batch (``batch.padded``, `engine.cuda_graphs`) brings exactly ``Q``
tokens per row; the tokens past a row's own are padding, which write the scratch slot and
block only (`engine.forward_batch.PaddedDecode`). Its shapes come from the padding, never
from the values: every token's closing entry is computed (those not closing go to the
scratch block) and attention gathers the context bucket's entries.
"""

from __future__ import annotations

import torch

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.forward_batch import ForwardBatch, upload
from engine.kernels import batch_invariant
from engine.model.compressor import Compressor, Indexer
from engine.model.decode import _csa_select, _gather_entries, closing_offsets, store_entries, take_rows
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
    """Where each flat token sits in the padded ``[B, Q]`` grid (built once per step)."""

    def __init__(self, batch: ForwardBatch) -> None:
        dev = batch.positions.device
        self.q = max(batch.query_len_cpu)
        self.n0 = batch.num_computed  # [B]
        self.slots = batch.swa_slot  # [B]
        self.pos = batch.positions  # [T]
        # [T] the slot each token's ring rows are written to (None: its sequence's)
        self.write_slots: torch.Tensor | None = None
        padded = batch.padded
        if padded is not None:  # every row brings q tokens: no host data (a graph's replays)
            flat = torch.arange(batch.num_tokens, device=dev)
            self.seq, self.col = flat // self.q, flat % self.q
            self.window_from = padded.window_from
            self.write_slots = padded.write_slot
            return
        seq = [i for i, n in enumerate(batch.query_len_cpu) for _ in range(n)]
        col = [j for n in batch.query_len_cpu for j in range(n)]
        self.seq = upload(torch.tensor(seq, dtype=torch.long), dev)  # [T] sequence of each token
        self.col = upload(torch.tensor(col, dtype=torch.long), dev)  # [T] its index in the sequence
        self.window_from = upload(torch.tensor(batch.window_from, dtype=torch.long), dev)  # [B]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Q, ...] (padding rows are zero)."""
        out = x.new_zeros(self.n0.shape[0], self.q, *x.shape[1:])
        out[self.seq, self.col] = x
        return out

    def old_rows(self, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' ring rows before the step [B, R, C] and the position each holds [B, R]
        (the latest position below ``n0`` congruent to the row; negative: none)."""
        r = ring.shape[1]
        last = (self.n0 - 1)[:, None]
        held = last - ((last - torch.arange(r, device=ring.device)[None, :]) % r)
        return ring[self.slots], held

    def write(self, ring: torch.Tensor, values: torch.Tensor) -> None:
        """Store each token's row [T, C] at its position (after every read of the step)."""
        slots = self.slots[self.seq] if self.write_slots is None else self.write_slots
        ring[slots, self.pos % ring.shape[1]] = values.to(ring.dtype)


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
    m = comp.rate
    ring_kv, ring_gate = swa.compressor_rings(layer, index)
    r = ring_kv.shape[1]
    kv_new, gate_new = comp.kv_proj(x), comp.gate_proj(x)  # [T, C]
    closes = (lay.pos + 1) % m == 0
    only = None
    if batch.padded is None:
        closing = closes.nonzero().flatten()
    else:  # fixed shapes: every token pools; those not closing, or padding, go to scratch
        closing = torch.arange(x.shape[0], device=x.device)
        only = (closes & batch.padded.real.bool(), batch.padded.scratch_block)
    if closing.numel():
        old_kv, _ = lay.old_rows(ring_kv)
        old_gate, _ = lay.old_rows(ring_gate)
        seq = lay.seq[closing]
        both_kv = torch.cat([old_kv, lay.pad(kv_new.to(old_kv.dtype))], dim=1)  # [B, R + Q, C]
        both_gate = torch.cat([old_gate, lay.pad(gate_new.to(old_gate.dtype))], dim=1)
        c = lay.pos[closing]  # [n]
        offs = closing_offsets(comp, c)
        n0 = lay.n0[seq][:, None]
        where = torch.where(offs < n0, offs % r, r + (offs - n0))  # old ring row, or R + new index
        kv = both_kv[seq[:, None], where]  # [n, span, C]
        gate = both_gate[seq[:, None], where]
        store_entries(comp, rotary, kv, gate, offs, c, batch.block_table[seq], pool, layer, index, only)
    lay.write(ring_kv, kv_new)
    lay.write(ring_gate, gate_new)


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
    s, p = lay.seq, lay.pos[:, None]
    held = p - (w - 1) + torch.arange(w, device=kv.device)[None, :]  # [T, W] positions
    n0 = lay.n0[s][:, None]
    old = take_rows(window_ring, lay.slots[s][:, None], held % w)  # [T, W, hd]
    new = take_rows(lay.pad(kv.to(old.dtype)), s[:, None], (held - n0).clamp(0, lay.q - 1))
    keys = torch.where((held < n0)[..., None], old, new)
    visible = (held >= 0) & (held >= lay.window_from[s][:, None]) & (held > p - window)
    lay.write(window_ring, kv)
    if compressed is None:
        return keys, visible
    rows, rate = compressed
    count = (lay.pos + 1) // rate  # [T] entries complete at each token
    if batch.padded is not None:  # a fixed shape: entries past a token's count are masked
        e_max = batch.padded.context // rate
    else:
        e_max = max(n0 + q for n0, q in zip(batch.num_computed_cpu, batch.query_len_cpu)) // rate
    if e_max == 0:
        return keys, visible
    table = batch.block_table[s]  # [T, nb]
    if csa is not None:
        ix, iq, iw, irows = csa
        top, cvis = _csa_select(ix, iq, iw, _gather_entries(irows, table, e_max), count)
        rpb = rows.shape[1]
        comp = take_rows(rows, table.gather(1, top // rpb).clamp(min=0), top % rpb)  # [T, k, hd]
    else:
        comp = _gather_entries(rows, table, e_max)  # [T, E, hd]
        cvis = torch.arange(e_max, device=kv.device)[None, :] < count[:, None]
    return torch.cat([keys, comp.to(keys.dtype)], dim=1), torch.cat([visible, cvis], dim=1)
