"""Checkpoint key names -> Sluice module names (which equal transformers' module names).

Accepted spellings: transformers' (``model.layers.0.self_attn.q_a_proj.weight``, packed
``mlp.experts.gate_up_proj``) and DeepSeek's released one (``layers.0.attn.wq_a.weight``,
per-expert ``ffn.experts.3.w1.weight``, ``embed.weight``, ``head.weight``), with or without a
``model.`` prefix; transformers' ``save_pretrained`` writes a mix of the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"(^|\.)hc_head_fn$", r"\1hc_head.hc_fn"),
    (r"(^|\.)hc_head_base$", r"\1hc_head.hc_base"),
    (r"(^|\.)hc_head_scale$", r"\1hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_COMPILED = tuple((re.compile(a), b) for a, b in _RENAMES)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|scale|weight_scale_inv)$")
_TOP = ("layers.", "embed_tokens.", "norm.", "hc_head.")


@dataclass(frozen=True)
class KeyRef:
    name: str  # canonical module key (for per-expert keys: the packed key)
    expert: int = -1  # >= 0 for DeepSeek's per-expert keys
    part: str = ""  # "w1" (gate), "w3" (up), "w2" (down)
    suffix: str = "weight"  # "weight", "scale" or "weight_scale_inv" for per-expert keys


def canonical(key: str) -> KeyRef:
    k = key[len("model.") :] if key.startswith("model.") else key
    for pat, rep in _COMPILED:
        k = pat.sub(rep, k)
    if k.startswith(_TOP):
        k = "model." + k
    m = _EXPERT.match(k)
    if m:
        packed = "gate_up_proj" if m.group(3) in ("w1", "w3") else "down_proj"
        return KeyRef(f"{m.group(1)}.{packed}", int(m.group(2)), m.group(3), m.group(4))
    return KeyRef(k)
