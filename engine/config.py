"""Frozen DeepSeek-V4 model configuration parsed from a Hugging Face `config.json`.

Both config spellings are accepted: transformers' (``layer_types``, ``mlp_layer_types``,
``rope_parameters = {"main": ..., "compress": ...}``, ``compress_rates``) and DeepSeek's
released one (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, flat
``rope_scaling``). Everything is settled at parse time; the object is never mutated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

#: One logical block of the compressed-state pool covers this many token positions.
BLOCK_TOKENS = 256


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE flavour: plain (``factor`` None) or YaRN with attention factor forced to 1."""

    theta: float
    rope_dim: int
    factor: float | None = None
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    quantization: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types ({len(self.mlp_layer_types)}) "
                f"must both have num_hidden_layers={n} entries"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer types {bad}; known: {LAYER_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in ("moe", "hash_moe")]
        if bad:
            raise ValueError(f"unknown mlp layer types {bad}; known: ('moe', 'hash_moe')")
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported; DeepSeek-V4 uses 'sqrtsoftplus'"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope dim {self.rope_dim} must be even and <= head_dim {self.head_dim}")
        if self.index_head_dim < self.rope_dim:
            raise ValueError(f"index_head_dim {self.index_head_dim} must be >= the rope dim {self.rope_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim}) must be "
                f"divisible by o_groups ({self.o_groups})"
            )
        for name, rate in (("csa", self.csa_rate), ("hca", self.hca_rate)):
            if rate <= 0 or BLOCK_TOKENS % rate:
                raise ValueError(f"{name} compression rate {rate} must divide the block size {BLOCK_TOKENS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.hc_mult < 1 or self.sliding_window < 1:
            raise ValueError("hc_mult and sliding_window must be >= 1")

    # ------------------------------------------------------------------ derived
    def rate(self, layer: int) -> int:
        """Compression rate of a layer (0 for sliding-only layers)."""
        t = self.layer_types[layer]
        return self.csa_rate if t == CSA else self.hca_rate if t == HCA else 0

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t != SLIDING)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type {d.get('model_type')!r} is not deepseek_v4")
        n = int(d["num_hidden_layers"])
        rates = dict(d.get("compress_rates") or {})
        csa_rate = int(d.get("compress_rate_csa") or rates.get(CSA) or 4)
        hca_rate = int(d.get("compress_rate_hca") or rates.get(HCA) or 128)
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
        if layer_types is None:
            raise ValueError("config.json needs layer_types (transformers) or compress_ratios (DeepSeek)")
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = int(d.get("head_dim", 512))
        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
        else:
            rope_dim = int(d.get("qk_rope_head_dim", 64))
        main, compress = _parse_rope(d, rope_dim)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(d["num_attention_heads"]),
            head_dim=head_dim,
            q_lora_rank=int(d["q_lora_rank"]),
            rope_dim=rope_dim,
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            n_routed_experts=int(d["n_routed_experts"]),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            sliding_window=int(d.get("sliding_window", 128)),
            o_groups=int(d.get("o_groups", 8)),
            o_lora_rank=int(d.get("o_lora_rank", 1024)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 512)),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            main_rope=main,
            compress_rope=compress,
            scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            quantization=dict(d.get("quantization_config") or {}),
        )


def _parse_rope(d: dict[str, Any], rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_d, comp_d = rp["main"], rp["compress"]
    else:
        flat = {
            **(d.get("rope_scaling") or {}),
            **{k: v for k, v in rp.items() if k not in ("main", "compress")},
        }
        main_d = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
        comp_d = {**flat, "rope_theta": d.get("compress_rope_theta", 160000.0)}
    main = RopeConfig(theta=float(main_d.get("rope_theta", 10000.0)), rope_dim=rope_dim)
    comp_type = comp_d.get("rope_type", comp_d.get("type", "default"))
    theta = float(comp_d.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
    if comp_type == "yarn":
        factor = comp_d.get("factor")
        orig = int(comp_d.get("original_max_position_embeddings", 0))
        if factor is None:
            factor = float(d.get("max_position_embeddings", 0)) / orig
        compress = RopeConfig(
            theta=theta,
            rope_dim=rope_dim,
            factor=float(factor),
            original_max_position=orig,
            beta_fast=float(comp_d.get("beta_fast") or 32.0),
            beta_slow=float(comp_d.get("beta_slow") or 1.0),
            truncate=bool(comp_d.get("truncate", True)),
        )
    elif comp_type == "default":
        compress = RopeConfig(theta=theta, rope_dim=rope_dim)
    else:
        raise ValueError(f"compress rope_type {comp_type!r} is not supported (known: default, yarn)")
    if compress.factor is not None and not math.isfinite(compress.factor):
        raise ValueError("YaRN factor must be finite")
    return main, compress
