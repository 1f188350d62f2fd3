"""V4 attention: shared-KV MQA over a 128-token sliding window plus compressed entries.

Per layer type: sliding (window only, plain RoPE), CSA (window + top-k of the rate-4 entries
chosen by the lightning indexer), HCA (window + every complete rate-128 entry). Per-head sink
logits join the softmax; V carries RoPE so the output is rotated back at the query position;
the output projection is grouped low-rank (block-diagonal ``o_a_proj`` then ``o_b_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.checkpoint.quant import dequantize
from engine.config import CSA, HCA, SLIDING, ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kernels import batch_invariant, fp8, tracks_grad
from engine.model import prefill, verify
from engine.model.compressor import CSACompressor, HCACompressor, Indexer, run_compressor
from engine.model.decode import decode_attend, decode_compress, decode_keys, written
from engine.model.norms import RMSNorm, rms_unweighted
from engine.model.rope import Rotary


class GroupedLinear(nn.Module):
    """Block-diagonal linear: weight [groups * out_per_group, in_per_group] (optionally kept quantised)."""

    qweight: torch.Tensor | None
    scale: torch.Tensor | None

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_features, in_per_group))
        self.register_buffer("qweight", None)
        self.register_buffer("scale", None)

    def set_quantized(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in] -> [T, G * out_per_group]."""
        if self.qweight is not None and self.scale is not None and self._fp8_groups(x):
            return self._forward_fp8(x)
        w = (
            self.weight
            if self.qweight is None or self.scale is None
            else dequantize(self.qweight, self.scale)
        )
        if self.qweight is not None:
            x = fp8.eager_input(x, self.qweight)  # w8a8's values, multiplied eagerly
        w = w.view(self.groups, -1, x.shape[-1]).to(x.dtype)  # [G, out, in]
        if x.is_cuda and not batch_invariant.enabled() and not tracks_grad(x, w):
            # cuBLAS reads x per group and writes each group's rows in place in [T, G, out]
            # (strided batches): no permuted copies of the input or the output
            y = x.new_empty(x.shape[0], self.groups, w.shape[1])
            torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
            return y.flatten(1)
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)

    def _fp8_groups(self, x: torch.Tensor) -> bool:
        """An FP8 weight whose 128-row scale blocks never straddle two groups, and rows the FP8
        kernel multiplies (`engine.kernels.fp8`)."""
        assert self.qweight is not None
        out = self.qweight.shape[0] // self.groups
        return out % fp8.BLOCK == 0 and fp8.usable(x, self.qweight)

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """The groups as the FP8 kernel's expert groups: rows [G * T, in] grouped by group."""
        assert self.qweight is not None and self.scale is not None
        t, g, k = x.shape
        out = self.qweight.shape[0] // g
        rows = x.transpose(0, 1).reshape(g * t, k)
        ends = (torch.arange(1, g + 1, device=x.device, dtype=torch.int32) * t).contiguous()
        q = self.qweight.view(g, out, k)
        s = self.scale.view(g, out // fp8.BLOCK, self.scale.shape[-1])
        y = fp8.grouped_matmul(rows, q, s, ends)  # [G * T, out]
        return y.view(g, t, out).transpose(0, 1).reshape(t, g * out)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups
        )
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.rotary = Rotary(cfg.main_rope if layer_type == SLIDING else cfg.compress_rope)
        self.compressor: CSACompressor | HCACompressor | None = None
        if layer_type == CSA:
            idx = Indexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_head_dim,
                cfg.index_n_heads,
                cfg.csa_rate,
                cfg.index_topk,
                cfg.rms_norm_eps,
            )
            self.compressor = CSACompressor(
                cfg.hidden_size, cfg.head_dim, cfg.csa_rate, cfg.rms_norm_eps, idx
            )
        elif layer_type == HCA:
            self.compressor = HCACompressor(cfg.hidden_size, cfg.head_dim, cfg.hca_rate, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        pool: CompressedPool,
        swa: SWASlots,
        layer: int,
        cached_until: tuple[int, ...],
    ) -> torch.Tensor:
        """x [T, D] (normed attention input) -> [T, D]."""
        pos = batch.positions
        q_latent = self.q_a_norm(self.q_a_proj(x))  # [T, q_lora]
        q = self.q_b_proj(q_latent).view(x.shape[0], self.n_heads, self.head_dim)  # [T, H, hd]
        q = self.rotary(rms_unweighted(q, self.eps), pos)
        kv = self.rotary(self.kv_norm(self.kv_proj(x)), pos)  # [T, hd], K == V
        if batch.is_decode:
            return self._forward_decode(x, q, kv, q_latent, batch, pool, swa, layer)
        if verify.applies(batch):
            return self._forward_verify(x, q, kv, q_latent, batch, pool, swa, layer)
        meta = [
            (
                batch.query_start_cpu[i],
                batch.query_len_cpu[i],
                batch.num_computed_cpu[i],
                batch.swa_slot_cpu[i],
                cached_until[i],
                batch.block_table[i],
            )
            for i in range(batch.num_seqs)
        ]
        window_from = batch.window_from
        idx: tuple[torch.Tensor, torch.Tensor] | None = None  # indexer queries [T, nI, dI], weights [T, nI]
        if self.compressor is not None:
            kept_rings = batch.kept_until(layer)
            run_compressor(self.compressor, self.rotary, x, meta, pool, swa, layer, False, kept_rings)
            if isinstance(self.compressor, CSACompressor):
                ix = self.compressor.indexer
                run_compressor(ix, self.rotary, x, meta, pool, swa, layer, True, kept_rings)
                idx = ix.queries(self.rotary, q_latent, x, pos)
        out = torch.empty_like(q)  # [T, H, hd]
        kept = batch.kept_until(layer)
        for i, (start, qlen, n0, slot, _, table) in enumerate(meta):
            sl = slice(start, start + qlen)
            kv_i = SWASlots.with_kept(swa.window[layer], slot, n0, kv[sl], kept[i])
            lo = min(n0, max(window_from[i], n0 - self.window + 1, 0))  # what the ring holds
            ring = SWASlots.ring_read(swa.window[layer], slot, lo, n0)
            raw = prefill.window_rows(ring, kv_i, self.window)
            compressed = csa = None
            if self.compressor is not None:
                n_entries = (n0 + qlen) // self.compressor.rate
                compressed = (pool.read(layer, table, n_entries).to(q.dtype), self.compressor.rate)
                if idx is not None and isinstance(self.compressor, CSACompressor):
                    ikeys = pool.read(layer, table, n_entries, index=True)
                    csa = (self.compressor.indexer, idx[0][sl], idx[1][sl], ikeys)
            prefill.attend_sequence(q[sl], raw, n0, lo, self.window, self.sinks, compressed, csa, out=out[sl])
            SWASlots.ring_write_from(swa.window[layer], slot, n0, kv_i, kept[i])
        out = self.rotary(out, pos, inverse=True)
        grouped = out.reshape(x.shape[0], self.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    def _forward_decode(self, x, q, kv, q_latent, batch, pool, swa, layer) -> torch.Tensor:
        """One token per sequence, no per-sequence loop (engine.model.decode)."""
        compressed = csa = None
        if self.compressor is not None:
            decode_compress(self.compressor, self.rotary, x, batch, pool, swa, layer, index=False)
            compressed = (pool.rows[layer], self.compressor.rate)
            if isinstance(self.compressor, CSACompressor):
                ix = self.compressor.indexer
                decode_compress(ix, self.rotary, x, batch, pool, swa, layer, index=True)
                iq, iw = ix.queries(self.rotary, q_latent, x, batch.positions)
                csa = (ix, iq, iw, pool.index_rows[layer])
        keys, visible = decode_keys(kv, batch, swa.window[layer], compressed, csa, written(batch, layer))
        out = decode_attend(q, keys, visible, self.sinks)
        out = self.rotary(out, batch.positions, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.reshape(x.shape[0], self.o_groups, -1)))

    def _forward_verify(self, x, q, kv, q_latent, batch, pool, swa, layer) -> torch.Tensor:
        """A few tokens per sequence (speculative verification), no per-sequence loop
        (engine.model.verify)."""
        lay = batch.verify_layout
        compressed = csa = None
        if self.compressor is not None:
            verify.verify_compress(self.compressor, self.rotary, x, lay, batch, pool, swa, layer, index=False)
            compressed = (pool.rows[layer], self.compressor.rate)
            if isinstance(self.compressor, CSACompressor):
                ix = self.compressor.indexer
                verify.verify_compress(ix, self.rotary, x, lay, batch, pool, swa, layer, index=True)
                iq, iw = ix.queries(self.rotary, q_latent, x, batch.positions)
                csa = (ix, iq, iw, pool.index_rows[layer])
        keys, visible = verify.verify_keys(kv, lay, batch, swa.window[layer], self.window, compressed, csa)
        out = decode_attend(q, keys, visible, self.sinks)
        out = self.rotary(out, batch.positions, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.reshape(x.shape[0], self.o_groups, -1)))
