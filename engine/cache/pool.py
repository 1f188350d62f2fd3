"""Paged pool of compressed rows (CSA rows, CSA indexer rows, HCA rows).

One physical block id addresses the same 256 token positions in every compressed layer:
layer l keeps ``rows[l]: [num_blocks, 256 // rate_l, head_dim]`` (and, for CSA,
``index_rows[l]: [num_blocks, 64, index_head_dim]``). Compressed entry w of a sequence (it
summarises positions up to ``w*rate + rate - 1``) lives in logical block ``w*rate // 256`` at
row ``w % (256 // rate)``. Blocks are immutable once full, so they can be shared between
sequences (prefix cache) and shipped to the KV store as they are.
"""

from __future__ import annotations

import torch

from engine.cache.spec import CacheSpec
from engine.config import CSA


class CompressedPool:
    def __init__(
        self, spec: CacheSpec, num_blocks: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.rows: dict[int, torch.Tensor] = {}
        self.index_rows: dict[int, torch.Tensor] = {}
        for layer, t in enumerate(spec.layer_types):
            if spec.rate(layer) == 0:
                continue
            rpb = spec.rows_per_block(layer)
            self.rows[layer] = torch.zeros(num_blocks, rpb, spec.head_dim, dtype=dtype, device=device)
            if t == CSA:
                self.index_rows[layer] = torch.zeros(
                    num_blocks, rpb, spec.index_head_dim, dtype=dtype, device=device
                )

    @staticmethod
    def _addr(table: torch.Tensor, entries: torch.Tensor, rpb: int) -> tuple[torch.Tensor, torch.Tensor]:
        return table[entries // rpb], entries % rpb

    def write(
        self, layer: int, table: torch.Tensor, first: int, rows: torch.Tensor, index: bool = False
    ) -> None:
        """Store entries [first, first + len(rows)) of one sequence (block table ``table [nb]``)."""
        if rows.shape[0] == 0:
            return
        store = self.index_rows[layer] if index else self.rows[layer]
        rpb = store.shape[1]
        entries = torch.arange(first, first + rows.shape[0], device=table.device)
        blk, row = self._addr(table, entries, rpb)
        store[blk, row] = rows.to(store.dtype)

    def read(self, layer: int, table: torch.Tensor, count: int, index: bool = False) -> torch.Tensor:
        """Entries [0, count) of one sequence: [count, dim]."""
        store = self.index_rows[layer] if index else self.rows[layer]
        rpb = store.shape[1]
        nb = -(-count // rpb)
        if count == 0:
            return store.new_zeros(0, store.shape[-1])
        return store[table[:nb]].reshape(-1, store.shape[-1])[:count]

    def block_tensors(self, block: int) -> list[torch.Tensor]:
        """Views of physical block ``block`` in the fixed payload order: for each compressed
        layer in layer order, ``rows[l][block]`` ([rpb_l, head_dim]), then for CSA layers
        ``index_rows[l][block]`` ([rpb_l, index_head_dim]). Raises IndexError out of range."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")
        out: list[torch.Tensor] = []
        for layer, store in self.rows.items():  # dict insertion order is layer order
            out.append(store[block])
            if layer in self.index_rows:
                out.append(self.index_rows[layer][block])
        return out

    def copy_block(self, src: int, dst: int) -> None:
        for store in list(self.rows.values()) + list(self.index_rows.values()):
            store[dst].copy_(store[src])
