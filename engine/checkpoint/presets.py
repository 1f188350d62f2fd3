"""DeepSeek-V4 checkpoint presets: random ones for `sluice gen-checkpoint`, shipped ones.

A random preset (``PRESETS``) is a set of ``DeepseekV4Config`` keyword arguments. ``tiny``
exercises every component on a CPU in well under a second; ``small`` keeps the real
129,280-token vocabulary for demos; ``flash-shape`` has DeepSeek-V4-Flash's real widths
with few layers, for GPU benchmarks.

A shipped preset (``SHIPPED``) is a trained checkpoint committed to the repository:
``trained`` (``models/trained``, built by ``sluice train model``) is the default model of
``sluice serve``, ``make run`` and ``examples/``. It is never generated.

``resolve_preset`` turns any preset name into a checkpoint directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.checkpoint")

# The repository root, from this file (engine/checkpoint/presets.py), not the working directory.
REPO_ROOT = Path(__file__).resolve().parents[2]
# Shipped presets: name -> checkpoint directory in the repository.
SHIPPED: dict[str, Path] = {"trained": REPO_ROOT / "models" / "trained"}
DEFAULT_PRESET = "trained"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# V4-Flash's compressed layers use YaRN (factor 16 over a 64K original context).
_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 1024,  # a cut of the V4 vocabulary (engine.checkpoint.tokenizer)
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [SLIDING, CSA, HCA, CSA],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "num_attention_heads": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,  # rope dim 8
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "sliding_window": 32,  # short, so tests wrap the window quickly
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 512,  # larger than any test's entry count: exact, no tie flips
        "max_position_embeddings": 8192,
        "num_nextn_predict_layers": 1,
        "dtype": "float32",
    },
    "small": {
        "vocab_size": 129280,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "layer_types": [SLIDING, CSA, HCA, CSA, HCA, SLIDING],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        "num_attention_heads": 8,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 128,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "hc_mult": 4,
        "sliding_window": 128,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 64,
        "max_position_embeddings": 65536,
        "num_nextn_predict_layers": 1,
        "dtype": "bfloat16",
    },
    "flash-shape": {
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": 4,
        "layer_types": [SLIDING, CSA, HCA, CSA],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "num_attention_heads": 64,
        "head_dim": 512,
        "partial_rotary_factor": 64 / 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "hc_mult": 4,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1,
        "dtype": "bfloat16",
    },
}

# The vision encoder (`engine.model.vision.VisionConfig`) written beside a preset's random weights,
# as config.json's ``vision`` section and ``vision/model.safetensors``; its ``text_hidden_size``
# is the preset's ``hidden_size``. A preset without an entry (flash-shape) gets no encoder.
VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "position_grid": 8},
    "small": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 128,
        "position_grid": 16,
    },
}

COMMON: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": dict(_YARN),
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "n_shared_experts": 1,
    "swiglu_limit": 10.0,
    "hc_eps": 1.0e-6,
    "rms_norm_eps": 1.0e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of a preset, with overrides applied (layers may be resized)."""
    if name in SHIPPED:
        raise ValueError(f"preset {name!r} is shipped (trained weights in {SHIPPED[name]}), not generated")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    cfg = {**COMMON, **PRESETS[name], **overrides}
    # YaRN's factor is max_position / original_max_position: keep the two consistent.
    rope = dict(cfg["rope_parameters"])
    rope["original_max_position_embeddings"] = int(cfg["max_position_embeddings"] // rope["factor"])
    cfg["rope_parameters"] = rope
    n = int(cfg["num_hidden_layers"])
    # A resized preset keeps its leading layers; extra layers alternate CSA/HCA with top-k MoE.
    attn = list(cfg["layer_types"])[:n]
    attn += [CSA if i % 2 == 0 else HCA for i in range(n - len(attn))]
    mlp = list(cfg["mlp_layer_types"])[:n]
    mlp += ["moe"] * (n - len(mlp))
    cfg["layer_types"], cfg["mlp_layer_types"] = attn, mlp
    return cfg


def preset_names() -> list[str]:
    """Every preset name, shipped and random."""
    return sorted({*SHIPPED, *PRESETS})


def resolve_preset(name: str, home: Path) -> Path:
    """The checkpoint directory of preset ``name``.

    A shipped preset is its directory in the repository (ValueError when it is missing). A
    random preset is generated (seed 0) under ``home/checkpoints/<name>`` on first use and
    reused afterwards; ``home`` is ``$SLUICE_HOME`` for the CLI and the examples.
    """
    if name in SHIPPED:
        path = SHIPPED[name]
        if not (path / "config.json").is_file():
            raise ValueError(
                f"shipped preset {name!r} is missing: no config.json in {path} (it ships in the "
                "repository checkout and is never generated; elsewhere, name a copy by its directory)"
            )
        return path
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    path = Path(home) / "checkpoints" / name
    if not (path / "config.json").is_file():
        from engine.checkpoint.generate import generate_checkpoint

        log.info("generating the %s checkpoint in %s (first use)", name, path)
        generate_checkpoint(name, path, seed=0)
    return path
