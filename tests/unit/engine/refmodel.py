"""Tiny random DeepSeek-V4 checkpoints built with the transformers reference (quirk params randomised)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    hc_mult=2,
    hc_sinkhorn_iters=20,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=512,
    sliding_window=16,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    num_nextn_predict_layers=1,
    swiglu_limit=1.0,
)

#: three checkpoints that together cover sliding/CSA/HCA, hash MoE, hc_mult >= 2 and MTP
CONFIGS: dict[str, dict[str, Any]] = {
    "mixed_hc2": {},
    "hc4_window128": dict(
        hc_mult=4,
        sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_hidden_layers=3,
    ),
    "csa_small_topk": dict(
        hc_mult=3,
        index_topk=4,
        layer_types=["compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_hidden_layers=3,
        num_experts_per_tok=3,
    ),
}


def _randomise(model: torch.nn.Module, cfg, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(("_norm.weight", "layernorm.weight", "norm.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(
                    torch.stack(
                        [
                            torch.randperm(cfg.n_routed_experts, generator=gen)[: b.shape[1]]
                            for _ in range(b.shape[0])
                        ]
                    )
                )
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def mtp_state(ref_model: torch.nn.Module, cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random MTP layer under ``mtp.0.*``: a (window-only, non-hash) decoder layer's keys plus the MTP extras."""
    last = len(cfg.layer_types) - 1
    src = {
        k[len(f"model.layers.{last}.") :]: v
        for k, v in ref_model.state_dict().items()
        if k.startswith(f"model.layers.{last}.")
    }
    out: dict[str, torch.Tensor] = {}
    for k, v in src.items():
        if ".compressor." in k or k.endswith("tid2eid") or "rotary" in k:
            continue
        out[f"mtp.0.{k}"] = (
            (v + 0.01 * torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v.clone()
        )
    d = cfg.hidden_size
    out["mtp.0.mlp.gate.e_score_correction_bias"] = torch.randn(cfg.n_routed_experts, generator=gen) * 0.1
    for name in ("e_proj", "h_proj"):
        out[f"mtp.0.{name}.weight"] = torch.randn(d, d, generator=gen) * 0.08
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
    n = cfg.hc_mult
    out["mtp.0.hc_head.hc_fn"] = torch.randn(n, n * d, generator=gen) * 0.08
    out["mtp.0.hc_head.hc_base"] = torch.randn(n, generator=gen) * 0.3
    out["mtp.0.hc_head.hc_scale"] = torch.ones(1)
    return {k: v.contiguous() for k, v in out.items()}


def build_reference(out_dir: Path, name: str = "mixed_hc2", seed: int = 0, **overrides: Any):
    """Save a random checkpoint (transformers keys + ``mtp.0.*``) and return the fp32 reference model."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = {**BASE, **CONFIGS[name], **overrides}
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**kw)
    cfg._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    _randomise(model, cfg, gen)
    model.save_pretrained(out_dir)
    save_file(mtp_state(model, cfg, gen), str(Path(out_dir) / "mtp.safetensors"))
    return model
