"""The trained preset's model, as trained: transformers' ``DeepseekV4ForCausalLM`` plus one MTP layer.

The main model is transformers' own module tree, so the trained weights load in
``DeepseekV4ForCausalLM`` (the correctness referee) without any key mapping. The MTP layer is
transformers' ``DeepseekV4DecoderLayer`` (sliding-window attention, top-k MoE) with the
projections DeepSeek-V3/V4 put in front of it, laid out exactly as the engine's
``engine.model.mtp.MTPLayer`` reads ``mtp.0.*``:

    x_t   = h_proj(hnorm(streams_t)) + e_proj(enorm(embed(token_{t+1})))   (per hc stream)
    out_t = decoder_layer(x)
    draft logits_t = lm_head(norm(hc_head(out_t)))  -> token_{t+2}

Three losses train it (``TrainModel.forward``):

* **next token**: cross-entropy of the main head;
* **MTP**: cross-entropy of the draft head one token further, weighted by ``mtp_weight``
  (DeepSeek-V3's multi-token-prediction objective; its gradient reaches the trunk too);
* **indexer**: the CSA lightning indexer picks its top-k compressed entries with a
  ``topk`` that carries no gradient, so it is trained by distillation, as DeepSeek-V3.2
  trains its indexer: KL divergence from the main attention's weights over the selected
  compressed entries (summed over heads) to the indexer's softmax over the same entries.
  The indexer's inputs are detached, so this loss moves only the indexer's parameters.

Top-k MoE routers are balanced without an auxiliary loss (DeepSeek-V3): after every step each
expert's score-correction bias moves by ``bias_rate`` towards the mean load
(``ExpertBalancer``). Hash-MoE layers route by a fixed random ``tid2eid`` table drawn from the
seed (distinct experts per token id), the one thing transformers leaves at zero.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.presets import COMMON, CSA, HCA, SLIDING
from engine.train.attention import WINDOWED_ATTENTION, register_windowed_attention

# The trained preset's shape. Every choice is a stated requirement or principle:
# * 8 layers holding every attention type (1 sliding, 4 CSA, 3 HCA) and both MoE kinds
#   (2 hash-MoE, then top-k MoE), a sliding window of 128 (V4's), mHC with 4 streams (V4's);
# * index_topk 256: a quarter of the 1,024 CSA entries of a 4,096-token context, so the
#   indexer's selection matters at the training length;
# * max_position_embeddings 65,536 with V4's YaRN factor 16 puts YaRN's original context at
#   4,096, the training context;
# * widths sized so the bf16 checkpoint (with transformers' fp32 modules kept fp32, and the
#   MTP layer) stays under 20 MB.
SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "layer_types": [SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe", "moe", "moe"],
    "num_attention_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 96,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 40,
    "hc_mult": 4,
    "sliding_window": 128,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 256,
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 1,
    "dtype": "bfloat16",
}


def model_config(vocab_size: int, bos: int, eos: int, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of the trained preset (``overrides`` shrink it for tests)."""
    cfg: dict[str, Any] = {**COMMON, **SHAPE, **overrides}
    cfg.update(vocab_size=int(vocab_size), bos_token_id=int(bos), eos_token_id=int(eos))
    rope = dict(cfg["rope_parameters"])
    rope["original_max_position_embeddings"] = int(cfg["max_position_embeddings"] // rope["factor"])
    cfg["rope_parameters"] = rope
    n = int(cfg["num_hidden_layers"])
    if len(cfg["layer_types"]) != n or len(cfg["mlp_layer_types"]) != n:
        raise ValueError("layer_types and mlp_layer_types must have num_hidden_layers entries")
    return cfg


def hf_config(cfg: dict[str, Any]) -> Any:
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "dtype", "sluice")})


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _mtp_layer_class() -> type[nn.Module]:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer,
        DeepseekV4HyperHead,
        DeepseekV4RMSNorm,
    )

    class MTPLayer(DeepseekV4DecoderLayer):
        """A decoder layer plus the MTP projections; its state dict is the engine's ``mtp.0.*``."""

        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            d, eps = config.hidden_size, config.rms_norm_eps
            self.e_proj = nn.Linear(d, d, bias=False)
            self.h_proj = nn.Linear(d, d, bias=False)
            self.enorm = DeepseekV4RMSNorm(d, eps=eps).to(dtype=torch.float32)
            self.hnorm = DeepseekV4RMSNorm(d, eps=eps).to(dtype=torch.float32)
            self.norm = DeepseekV4RMSNorm(d, eps=eps).to(dtype=torch.float32)
            self.hc_head = DeepseekV4HyperHead(config).to(dtype=torch.float32)

    return MTPLayer


class IndexerDistillation:
    """Collects, per CSA layer and forward pass, what the indexer's KL loss needs (see the module doc)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.records: list[dict[str, torch.Tensor]] = []
        self._current: dict[int, dict[str, torch.Tensor]] = {}
        self.enabled = True
        for i, layer in enumerate(layers):
            attn: Any = layer.self_attn
            if attn.compressor is None or not hasattr(attn.compressor, "indexer"):
                continue
            indexer = attn.compressor.indexer
            indexer.register_forward_pre_hook(self._detach_inputs)
            indexer.scorer.register_forward_hook(self._keep("scores", i))
            indexer.register_forward_hook(self._keep("topk", i))
            attn.register_forward_hook(self._keep_attention(i))

    @staticmethod
    def _detach_inputs(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def _keep(self, what: str, i: int) -> Any:
        def hook(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self.enabled:
                self._current.setdefault(i, {})[what] = out

        return hook

    def _keep_attention(self, i: int) -> Any:
        def hook(_module: nn.Module, _args: tuple[Any, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self.enabled and i in self._current:
                rec = self._current.pop(i)
                rec["weights"] = out[1]
                self.records.append(rec)

        return hook

    def loss(self) -> torch.Tensor | None:
        """Mean KL over CSA layers and over queries with at least one selected entry; clears the records."""
        records, self.records, self._current = self.records, [], {}
        if not records:
            return None
        total = []
        for rec in records:
            scores, topk, weights = rec["scores"], rec["topk"], rec["weights"]
            n_entries = scores.shape[-1]
            if n_entries == 0:
                continue
            selected = torch.zeros_like(scores, dtype=torch.bool)
            selected.scatter_(-1, topk.clamp(min=0), topk >= 0)
            # The main attention's weight on each compressed entry, summed over heads.
            target = weights[..., -n_entries:].detach().float().sum(dim=1)
            target = target.masked_fill(~selected, 0.0)
            mass = target.sum(dim=-1, keepdim=True)
            valid = mass.squeeze(-1) > 0
            if not bool(valid.any()):
                continue
            p = target / mass.clamp(min=1e-30)
            log_q = scores.float().masked_fill(~selected, float("-inf")).log_softmax(dim=-1)
            kl = (p * (p.clamp(min=1e-30).log() - log_q.masked_fill(~selected, 0.0))).sum(dim=-1)
            total.append(kl[valid].mean())
        if not total:
            return None
        return torch.stack(total).mean()


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: counts each top-k router's picks over a
    step, then moves its ``e_score_correction_bias`` by ``rate`` towards the mean load."""

    def __init__(self, routers: list[Any], rate: float) -> None:  # transformers' DeepseekV4TopKRouter
        self.rate = rate
        self.routers = routers
        self.counts = [torch.zeros(r.num_experts) for r in routers]
        for i, router in enumerate(routers):
            router.register_forward_hook(self._count(i))
        self.enabled = True

    def _count(self, i: int) -> Any:
        def hook(module: Any, _args: tuple[Any, ...], out: tuple[torch.Tensor, ...]) -> None:
            if self.enabled and module.training:
                idx = out[2].reshape(-1)
                c = torch.bincount(idx, minlength=module.num_experts).to(torch.float32)
                self.counts[i] = self.counts[i].to(c.device) + c

        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply and reset; returns the worst layer's max/mean load ratio of this step."""
        worst = 0.0
        for router, counts in zip(self.routers, self.counts, strict=True):
            mean = counts.mean()
            if mean <= 0:
                continue
            router.e_score_correction_bias.add_(
                self.rate * torch.sign(mean - counts).to(router.e_score_correction_bias)
            )
            worst = max(worst, float(counts.max() / mean))
        self.counts = [torch.zeros_like(c) for c in self.counts]
        return worst


class TrainModel(nn.Module):
    """transformers' DeepseekV4ForCausalLM plus one MTP layer, with the three training losses."""

    def __init__(
        self, cfg: dict[str, Any], seed: int, bias_rate: float = 1e-2, attention: str = WINDOWED_ATTENTION
    ) -> None:
        super().__init__()
        from transformers import DeepseekV4ForCausalLM
        from transformers.masking_utils import create_sliding_window_causal_mask

        self._mask_fn = create_sliding_window_causal_mask
        self.cfg = cfg
        self.hf_cfg = hf_config(cfg)
        self.hf_cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        self.lm = DeepseekV4ForCausalLM(self.hf_cfg)
        if attention == WINDOWED_ATTENTION:
            register_windowed_attention()
        self.lm.config._attn_implementation = attention
        self._mask_cfg = copy.deepcopy(self.hf_cfg)  # both attentions take eager's additive mask
        self._mask_cfg._attn_implementation = "eager"
        n = self.hf_cfg.num_hidden_layers
        mtp_cfg = copy.deepcopy(self.hf_cfg)
        mtp_cfg.layer_types = [*self.hf_cfg.layer_types, SLIDING]
        mtp_cfg.mlp_layer_types = [*self.hf_cfg.mlp_layer_types, "moe"]
        mtp_cfg.num_hidden_layers = n + 1
        self.mtp = _mtp_layer_class()(mtp_cfg, n)
        self.mtp.apply(self.lm._init_weights)
        self._randomise_hash_tables(seed)
        self.indexer = IndexerDistillation([*self.lm.model.layers, self.mtp])
        routers = [m for m in self.modules() if type(m).__name__ == "DeepseekV4TopKRouter"]
        self.balancer = ExpertBalancer(routers, bias_rate)

    @torch.no_grad()
    def _randomise_hash_tables(self, seed: int) -> None:
        n_experts = int(self.hf_cfg.n_routed_experts)
        for name, buf in self.named_buffers():
            if name.endswith("tid2eid"):
                gen = torch.Generator().manual_seed(_seed_for(seed, name))
                rows = torch.rand(buf.shape[0], n_experts, generator=gen).argsort(dim=1)[:, : buf.shape[1]]
                buf.copy_(rows)

    def trunk(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """ids [B, S] -> the last layer's hc streams [B, S, hc, D] and the per-layer kwargs."""
        model = self.lm.model
        emb = model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        mask = self._mask_fn(
            config=self._mask_cfg, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos
        )
        kwargs = {
            "position_embeddings": {
                "main": model.rotary_emb(emb, position_ids=pos, layer_type="main"),
                "compress": model.rotary_emb(emb, position_ids=pos, layer_type="compress"),
            },
            "position_ids": pos,
            "attention_mask": mask,
        }
        streams = emb.unsqueeze(2).expand(-1, -1, self.hf_cfg.hc_mult, -1).contiguous()
        for layer in model.layers:
            streams = layer(streams, input_ids=ids, **kwargs)
        return streams, kwargs

    def main_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.lm.model.norm(self.lm.model.hc_head(streams)))

    def mtp_streams(
        self, streams: torch.Tensor, next_ids: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        m: Any = self.mtp
        emb = self.lm.model.embed_tokens(next_ids)
        x = m.h_proj(m.hnorm(streams)) + m.e_proj(m.enorm(emb)).unsqueeze(2)
        return m(x, input_ids=next_ids, **kwargs)

    def draft_passes(
        self, streams: torch.Tensor, next_ids: torch.Tensor, kwargs: dict[str, Any], depth: int
    ) -> Iterator[torch.Tensor]:
        """The MTP layer chained the way speculation chains it, over every position at once.

        Pass 1 reads the trunk's ``streams``; pass ``j > 1`` reads pass ``j - 1``'s output one
        position earlier. At position ``q`` every pass takes the embedding of ``next_ids[q]``
        and predicts the token after it, so pass ``j`` at ``q`` is draft ``j`` of the chain
        anchored at ``q - j + 1`` (positions ``q < j - 1`` have no anchor). Each pass attends
        over its own earlier positions; an engine's reused MTP window holds pass-1 entries
        there (docs/training.md). Yields each pass's output streams [B, S, hc, D]."""
        hidden = streams
        for j in range(1, depth + 1):
            if j > 1:
                hidden = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
            hidden = self.mtp_streams(hidden, next_ids, kwargs)
            yield hidden

    def mtp_hidden(self, mtp_streams: torch.Tensor) -> torch.Tensor:
        """An MTP pass's output streams collapsed and normed: what ``lm_head`` turns into the
        draft's logits, and the confidence head's ``h``."""
        m: Any = self.mtp
        return m.norm(m.hc_head(mtp_streams))

    def mtp_logits(self, mtp_streams: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.mtp_hidden(mtp_streams))

    def forward(self, x: torch.Tensor, y: torch.Tensor, ul_window: int = 0) -> dict[str, torch.Tensor]:
        """x [B, S] inputs, y [B, S] next tokens -> losses: ``lm``, ``mtp`` (token after next),
        ``indexer``, and ``ul`` (``unlikelihood`` over the last ``ul_window`` tokens; 0 when 0)."""
        self.indexer.records.clear()
        streams, kwargs = self.trunk(x)
        vocab = self.hf_cfg.vocab_size
        logits = self.main_logits(streams).float()
        lm = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        mtp_out = self.mtp_streams(streams, y, kwargs)
        mtp_logits = self.mtp_logits(mtp_out[:, :-1]).float()
        mtp = F.cross_entropy(mtp_logits.reshape(-1, vocab), y[:, 1:].reshape(-1))
        idx = self.indexer.loss()
        out = {"lm": lm, "mtp": mtp}
        out["indexer"] = idx if idx is not None else lm.new_zeros(())
        out["ul"] = unlikelihood(logits, y, ul_window) if ul_window > 0 else lm.new_zeros(())
        return out


def unlikelihood(logits: torch.Tensor, y: torch.Tensor, window: int) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al., 2019, "Neural Text Generation with
    Unlikelihood Training"), mean per position: at position t the negative candidates are
    the tokens of the ``window`` positions before it (``y[t - window .. t - 1]``, the context
    the model just read) other than the target ``y[t]``, and each adds ``-log(1 - p(c))``.
    It lowers the probability of repeating recent text where the data does not repeat it,
    the mechanism behind greedy repetition loops, and leaves the target's own term to the
    cross-entropy. logits [B, S, V] (float), y [B, S]."""
    b, s, v = logits.shape
    cand = torch.zeros(b, s, v, dtype=torch.bool, device=logits.device)
    for o in range(1, min(window, s - 1) + 1):
        cand[:, o:].scatter_(2, y[:, : s - o, None], True)
    cand.scatter_(2, y[..., None], False)
    p = logits.softmax(-1)
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * cand).sum() / (b * s)


def export_state(model: TrainModel) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names transformers (main model) and the engine (``mtp.0.*``) read."""
    from engine.checkpoint.generate import stored_dtype

    target = getattr(torch, model.cfg["dtype"])
    state: dict[str, torch.Tensor] = {}
    for name, t in model.lm.state_dict().items():
        state[name] = t
    for name, t in model.mtp.state_dict().items():
        state["mtp.0." + name] = t
    return {
        name: t.detach().to("cpu", stored_dtype(name, t.dtype, target)).contiguous()
        for name, t in sorted(state.items())
    }


def load_trained(model_dir: Any, device: str | torch.device = "cpu") -> TrainModel:
    """A `TrainModel` holding a written checkpoint's weights (main model and ``mtp.0.*``), in fp32."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(model_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures", None)
    cfg.pop("sluice", None)
    model = TrainModel(cfg, seed=0)
    state = load_file(str(path / "model.safetensors"))
    mtp = {
        k[len("mtp.0.") :]: v.float() if v.is_floating_point() else v
        for k, v in state.items()
        if k.startswith("mtp.0.")
    }
    main = {
        k: v.float() if v.is_floating_point() else v for k, v in state.items() if not k.startswith("mtp.")
    }
    model.lm.load_state_dict(main, strict=True)
    model.mtp.load_state_dict(mtp, strict=True)
    return model.to(device)
