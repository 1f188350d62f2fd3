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
    """The rings live in a few banks, one per ring shape ``[R, C]`` (``banks``: each
    ``[rings, num_slots, R, C]``); ``window[l]``, ``state_kv[l]`` and the rest are views of
    one bank's entries. A speculative step's staging (`stage`) and putting back
    (`StagedRows.undo`) then take one gather and one scatter a bank rather than one a ring:
    the trained preset's 30 rings are 3 banks, V4-Flash's 168 also 3 (its HCA layers'
    compressor rings have the windows' shape), and `copy_slot` one copy a bank."""

    def __init__(
        self, spec: CacheSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        # every ring's (kind, layer, R, C), in the order the banks hold them
        kinds: list[tuple[str, int, int, int]] = []
        for layer, t in enumerate(spec.layer_types):
            kinds.append(("window", layer, spec.window, spec.head_dim))
            r = spec.state_window(layer)
            if r == 0:
                continue
            c = 2 * spec.head_dim if t == CSA else spec.head_dim
            kinds += [("state_kv", layer, r, c), ("state_gate", layer, r, c)]
            if t == CSA:
                ci = 2 * spec.index_head_dim
                kinds += [("index_kv", layer, r, ci), ("index_gate", layer, r, ci)]
        shapes = list(dict.fromkeys((r, c) for _, _, r, c in kinds))
        count = {shape: sum((r, c) == shape for _, _, r, c in kinds) for shape in shapes}
        self.banks = [
            torch.zeros(count[shape], num_slots, *shape, dtype=dtype, device=device) for shape in shapes
        ]
        self.window: list[torch.Tensor] = []
        self.state_kv: dict[int, torch.Tensor] = {}
        self.state_gate: dict[int, torch.Tensor] = {}
        self.index_kv: dict[int, torch.Tensor] = {}
        self.index_gate: dict[int, torch.Tensor] = {}
        # per layer, (bank, entry) of each of its rings, in `layer_rings` order
        self._homes: list[list[tuple[int, int]]] = [[] for _ in spec.layer_types]
        taken = dict.fromkeys(shapes, 0)
        for kind, layer, r, c in kinds:
            bank = shapes.index((r, c))
            ring = self.banks[bank][taken[(r, c)]]
            self._homes[layer].append((bank, taken[(r, c)]))
            taken[(r, c)] += 1
            if kind == "window":
                self.window.append(ring)
            else:
                getattr(self, kind)[layer] = ring
        self._plans: dict[tuple[int, ...], list[_BankPlan]] = {}

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
        Positions of one slot must map to distinct rows of every ring (at most R of them).
        One gather a bank: the rows of every staged ring of it at once."""
        plans = self._plan(tuple(layers))
        # [2, N]: one upload; each staged row's flat index in a bank [rings * num_slots * R, C]
        # is its ring's offset plus the row's index within a ring, slot * R + position % R
        slot_t, pos_t = upload(long_tensor([slots, positions]), self.window[0].device)
        staged = []
        within: dict[int, torch.Tensor] = {}  # per ring length R: [N] (banks share a few)
        for plan in plans:
            r = plan.ring_rows
            if r not in within:
                within[r] = slot_t * r + pos_t % r
            rows = (plan.offsets[:, None] + within[r]).view(-1)  # ring by ring: [rings staged * N]
            staged.append((plan.flat, rows, plan.flat.index_select(0, rows)))
        return StagedRows(slot_t, pos_t, staged)

    def _plan(self, layers: tuple[int, ...]) -> list[_BankPlan]:
        """Which entries of which banks the rings of ``layers`` are, per bank (cached: a
        runner stages the same layers every step)."""
        plans = self._plans.get(layers)
        if plans is None:
            entries: dict[int, list[int]] = {}
            for layer in layers:
                for bank, entry in self._homes[layer]:
                    entries.setdefault(bank, []).append(entry)
            plans = []
            for bank, taken in entries.items():
                b = self.banks[bank]
                ring_rows = b.shape[2]
                per_ring = self.num_slots * ring_rows
                offsets = long_tensor([e * per_ring for e in taken]).to(b.device)
                plans.append(_BankPlan(b.view(-1, b.shape[-1]), ring_rows, offsets))
            self._plans[layers] = plans
        return plans

    def copy_slot(self, src: int, dst: int) -> None:
        """Make slot ``dst`` an exact copy of slot ``src`` (prefix hit on another sequence's state, n>1 forks)."""
        for bank in self.banks:
            bank[:, dst].copy_(bank[:, src])

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


@dataclass(frozen=True)
class _BankPlan:
    """The staged rings of one bank: the bank as rows, a ring's length R, and the flat row
    offset of each staged ring in it."""

    flat: torch.Tensor  # [rings * num_slots * R, C]
    ring_rows: int  # R
    offsets: torch.Tensor  # [rings staged]


@dataclass
class StagedRows:
    """Ring rows saved by `SWASlots.stage` before a step writes over them."""

    slots: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    # per bank: (the bank as rows, the staged rows' flat indices ring by ring [rings * N],
    # their saved values [rings * N, C])
    banks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def undo(self, rejected: list[bool]) -> None:
        """Put back the saved rows of the staged positions marked rejected (their writes
        never happened, as far as any later step can see); the rest keep what was written."""
        if not any(rejected):
            return
        sel = None
        if not all(rejected):
            # an index built on the host: a boolean mask's size would need a device round trip
            sel = upload(long_tensor([i for i, r in enumerate(rejected) if r]), self.slots.device)
        n = self.slots.shape[0]
        for flat, rows, saved in self.banks:
            if sel is not None:  # the same positions of every ring
                rows = rows.view(-1, n)[:, sel].reshape(-1)
                saved = saved.view(-1, n, saved.shape[-1])[:, sel].reshape(-1, saved.shape[-1])
            flat.index_copy_(0, rows, saved)
