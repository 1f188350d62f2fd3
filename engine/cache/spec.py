"""Cache geometry and bytes per token per layer type (the formulas `docs/engine.md` quotes).

Per layer, with head dim D, indexer head dim D_I, window W, CSA rate m=4, HCA rate m'=128,
element size e (model dtype) and s (compressor-state dtype):

- raw sliding window (every layer, in the SWA slot):  W * D * e per sequence, i.e. D*e per
  token, bounded to W tokens;
- CSA compressed row (paged):      D * e / m    per token;
- CSA indexer row (paged):         D_I * e / m  per token;
- HCA compressed row (paged):      D * e / m'   per token;
- CSA compressor state (SWA slot): 2m tokens * (2D + 2D) * s      (kv and gate of Ca|Cb);
- CSA indexer state (SWA slot):    2m tokens * (2D_I + 2D_I) * s;
- HCA compressor state (SWA slot): m' tokens * (D + D) * s.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import BLOCK_TOKENS, CSA, HCA, SLIDING, ModelConfig


@dataclass(frozen=True)
class CacheSpec:
    layer_types: tuple[str, ...]  # main layers then MTP layers (sliding)
    head_dim: int
    index_head_dim: int
    window: int
    csa_rate: int
    hca_rate: int
    elem_bytes: int = 4
    state_bytes: int = 4

    @classmethod
    def from_model(cls, cfg: ModelConfig, elem_bytes: int = 4, state_bytes: int = 4) -> CacheSpec:
        types = cfg.layer_types + (SLIDING,) * cfg.num_nextn_predict_layers
        return cls(
            types,
            cfg.head_dim,
            cfg.index_head_dim,
            cfg.sliding_window,
            cfg.csa_rate,
            cfg.hca_rate,
            elem_bytes,
            state_bytes,
        )

    def rate(self, layer: int) -> int:
        t = self.layer_types[layer]
        return self.csa_rate if t == CSA else self.hca_rate if t == HCA else 0

    def state_window(self, layer: int) -> int:
        """Tokens of projected compressor input kept in the slot (ring size): 2m for CSA, m' for HCA."""
        t = self.layer_types[layer]
        return 2 * self.csa_rate if t == CSA else self.hca_rate if t == HCA else 0

    def rows_per_block(self, layer: int) -> int:
        return BLOCK_TOKENS // self.rate(layer)

    # -------------------------------------------------------------- paged bytes
    def paged_bytes_per_token(self, layer_type: str) -> float:
        """Compressed-pool bytes one token costs in one layer of this type (rows / rate)."""
        if layer_type == CSA:
            return (self.head_dim + self.index_head_dim) * self.elem_bytes / self.csa_rate
        if layer_type == HCA:
            return self.head_dim * self.elem_bytes / self.hca_rate
        return 0.0

    def paged_bytes_per_block(self) -> int:
        """Bytes of one physical block (256 positions) summed over all layers."""
        return int(sum(self.paged_bytes_per_token(t) for t in self.layer_types) * BLOCK_TOKENS)

    # -------------------------------------------------------------- slot bytes
    def window_bytes(self) -> int:
        """Raw window of one layer for one sequence."""
        return self.window * self.head_dim * self.elem_bytes

    def state_bytes_of(self, layer_type: str) -> int:
        """Compressor (and indexer) partial-window + overlap state of one layer for one sequence."""
        if layer_type == CSA:
            main = 2 * self.csa_rate * 4 * self.head_dim
            idx = 2 * self.csa_rate * 4 * self.index_head_dim
            return (main + idx) * self.state_bytes
        if layer_type == HCA:
            return self.hca_rate * 2 * self.head_dim * self.state_bytes
        return 0

    def slot_bytes(self) -> int:
        """One sequence's SWA slot: every layer's window plus its compressor state."""
        return sum(self.window_bytes() + self.state_bytes_of(t) for t in self.layer_types)
