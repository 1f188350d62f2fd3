"""One fixed-size sliding-window slot per sequence.

Per layer a slot holds
- the raw window: a ring ``window[l]: [num_slots, W, head_dim]``; position p lives at p % W;
- for compressed layers, the compressor's input ring ``state_kv[l], state_gate[l]:
  [num_slots, R, C]`` holding the projected kv and gate (before ``position_bias``) of the
  last R positions (p at p % R): R = 2m, C = 2*head_dim for CSA (the open window plus the
  previous window whose Ca half overlaps the next entry); R = m', C = head_dim for HCA (the
  open window only); CSA layers keep the same for the indexer (C = 2*index_head_dim).

State "valid at n" (n = tokens computed) means: the ring holds positions
[max(0, n - W), n) of the raw window and [max(0, floor(n/m)*m - m_overlap), n) of the
compressor input, where m_overlap = m for CSA and 0 for HCA.

Rebuilding a slot for a sequence whose compressed blocks are cached up to n (a prefix hit
whose SWA state is gone), exactly: replay positions [n - r, n) into a fresh slot with
``num_computed = window_from = n - r`` and ``rows_cached_until = n`` (the replay reads the
cached rows and never rewrites them), where

    r = min(n, L * (W - 1))    L = decoder layers (+1 if the MTP layer's window is kept), W = window

Why L * (W - 1): layer l's window keys at positions [n - W + 1, n) depend on layer l-1's
attention outputs there, which depend on layer l-1's keys W - 1 positions further back, and so
on down to the embeddings, which are exact everywhere. The compressor rings need at most
max(2m, m') - 1 <= W - 1 trailing positions (m' <= W holds for V4), which this covers. For V4-Flash (43 layers, W=128)
that is 5,461 tokens; replaying only the last W - 1 = 127 tokens with the window truncated to the
replay (DeepInfer's "bounded replay") is approximate: layers above the first see hidden states
computed from truncated windows. `tests/unit/engine/test_prefix_and_mtp.py` checks both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.cache.spec import CacheSpec
from engine.config import CSA
from engine.forward_batch import long_tensor, upload


class SWASlots:
    def __init__(
        self, spec: CacheSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.window: list[torch.Tensor] = []
        self.state_kv: dict[int, torch.Tensor] = {}
        self.state_gate: dict[int, torch.Tensor] = {}
        self.index_kv: dict[int, torch.Tensor] = {}
        self.index_gate: dict[int, torch.Tensor] = {}
        for layer, t in enumerate(spec.layer_types):
            self.window.append(torch.zeros(num_slots, spec.window, spec.head_dim, dtype=dtype, device=device))
            r = spec.state_window(layer)
            if r == 0:
                continue
            c = 2 * spec.head_dim if t == CSA else spec.head_dim
            self.state_kv[layer] = torch.zeros(num_slots, r, c, dtype=dtype, device=device)
            self.state_gate[layer] = torch.zeros(num_slots, r, c, dtype=dtype, device=device)
            if t == CSA:
                ci = 2 * spec.index_head_dim
                self.index_kv[layer] = torch.zeros(num_slots, r, ci, dtype=dtype, device=device)
                self.index_gate[layer] = torch.zeros(num_slots, r, ci, dtype=dtype, device=device)

    def _all(self, layers: int | None = None) -> list[torch.Tensor]:
        """Every ring, windows first, each kind in layer order; only layers below ``layers``
        when given (a host slot that keeps the first layers only)."""
        keep = len(self.window) if layers is None else layers
        rings = [self.state_kv, self.state_gate, self.index_kv, self.index_gate]
        return self.window[:keep] + [t for ring in rings for layer, t in ring.items() if layer < keep]

    @property
    def num_layers(self) -> int:
        return len(self.window)

    def slot_tensors(self, slot: int, layers: int | None = None) -> list[torch.Tensor]:
        """Views of one slot in ``_all()`` order (every window, then state_kv, state_gate,
        index_kv, index_gate, each in layer order), of the first ``layers`` layers when given.
        Raises IndexError out of range."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        if layers is not None and not 1 <= layers <= self.num_layers:
            raise IndexError(f"layers {layers} out of range [1, {self.num_layers}]")
        return [t[slot] for t in self._all(layers)]

    def compressor_rings(self, layer: int, index: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The (kv, gate) input rings of a layer's compressor, or of its indexer's."""
        if index:
            return self.index_kv[layer], self.index_gate[layer]
        return self.state_kv[layer], self.state_gate[layer]

    def layer_rings(self, layers: Iterable[int]) -> list[torch.Tensor]:
        """Every ring of the given layers (window, compressor and indexer inputs)."""
        rings = [self.state_kv, self.state_gate, self.index_kv, self.index_gate]
        return [t for layer in layers for t in (self.window[layer], *(r[layer] for r in rings if layer in r))]

    def stage(self, layers: Iterable[int], slots: list[int], positions: list[int]) -> StagedRows:
        """Save the ring rows that writes of ``positions`` (``slots[i]`` at ``positions[i]``)
        will overwrite, in every ring of ``layers``, so that the writes can be undone
        (`StagedRows.undo`): speculative verification writes drafts that may be rejected.
        Positions of one slot must map to distinct rows of every ring (at most R of them)."""
        rings = self.layer_rings(layers)
        device = self.window[0].device
        # [2, N]: one upload; each staged row's flat index in a ring [num_slots * R, C], built
        # once per ring length R (a layer's rings share a few), then one gather per ring
        slot_t, pos_t = upload(long_tensor([slots, positions]), device)
        rows: dict[int, torch.Tensor] = {}
        for ring in rings:
            r = ring.shape[1]
            if r not in rows:
                rows[r] = slot_t * r + pos_t % r
        saved = [_flat(ring).index_select(0, rows[ring.shape[1]]) for ring in rings]
        return StagedRows(rings, slot_t, pos_t, saved, rows)

    def copy_slot(self, src: int, dst: int) -> None:
        """Make slot ``dst`` an exact copy of slot ``src`` (prefix hit on another sequence's state, n>1 forks)."""
        for t in self._all():
            t[dst].copy_(t[src])

    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._all())

    # ------------------------------------------------------------ ring helpers
    @staticmethod
    def ring_read(ring: torch.Tensor, slot: int, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of a ring [num_slots, R, C] -> [end - start, C]."""
        r = ring.shape[1]
        idx = torch.arange(start, end, device=ring.device) % r
        return ring[slot, idx]

    @staticmethod
    def ring_write(ring: torch.Tensor, slot: int, start: int, values: torch.Tensor) -> None:
        """Store values [N, C] for positions [start, start + N); only the last R survive."""
        r = ring.shape[1]
        n = values.shape[0]
        keep = min(n, r)
        idx = torch.arange(start + n - keep, start + n, device=ring.device) % r
        ring[slot, idx] = values[n - keep :].to(ring.dtype)

    @staticmethod
    def with_kept(
        ring: torch.Tensor, slot: int, start: int, values: torch.Tensor, keep_until: int
    ) -> torch.Tensor:
        """``values`` [N, C] for positions [start, start + N), with those below ``keep_until``
        that the ring still holds taken from the ring (exact state a kept host-slot layer
        restored): a step then sees the same keys however it is chunked, and the same as the
        decode path, which reads them from the ring."""
        lo = max(start, keep_until - ring.shape[1])
        hi = min(start + values.shape[0], keep_until)
        if lo >= hi:
            return values
        out = values.clone()
        out[lo - start : hi - start] = SWASlots.ring_read(ring, slot, lo, hi).to(values.dtype)
        return out

    @staticmethod
    def ring_write_from(
        ring: torch.Tensor, slot: int, start: int, values: torch.Tensor, keep_until: int
    ) -> None:
        """``ring_write`` of the positions at or above ``keep_until`` only: the ring already
        holds exact state below it (a host slot that kept this layer; ForwardBatch.swa_keep)."""
        skip = min(values.shape[0], max(0, keep_until - start))
        if skip < values.shape[0]:
            SWASlots.ring_write(ring, slot, start + skip, values[skip:])


@dataclass
class StagedRows:
    """Ring rows saved by `SWASlots.stage` before a step writes over them."""

    rings: list[torch.Tensor]
    slots: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    saved: list[torch.Tensor]  # per ring [N, C]
    rows: dict[int, torch.Tensor]  # per ring length R: [N] flat row index in [num_slots * R, C]

    def undo(self, rejected: list[bool]) -> None:
        """Put back the saved rows of the staged positions marked rejected (their writes
        never happened, as far as any later step can see); the rest keep what was written."""
        if not any(rejected):
            return
        rows, saved = self.rows, self.saved
        if not all(rejected):
            # an index built on the host: a boolean mask's size would need a device round trip
            sel = upload(long_tensor([i for i, r in enumerate(rejected) if r]), self.slots.device)
            rows = {r: index[sel] for r, index in rows.items()}
            saved = [kept[sel] for kept in saved]
        for ring, kept in zip(self.rings, saved):
            _flat(ring).index_copy_(0, rows[ring.shape[1]], kept)


def _flat(ring: torch.Tensor) -> torch.Tensor:
    """A ring [num_slots, R, C] as rows [num_slots * R, C] (a view: rings are contiguous)."""
    return ring.view(-1, ring.shape[-1])
