"""Random DeepSeek-V4 checkpoints in the Hugging Face layout (`sluice gen-checkpoint`).

Writes config.json (``model_type: deepseek_v4``), generation_config.json, the tokenizer and
safetensors weights under transformers' module key names, plus one MTP layer under
``mtp.0.*`` (a decoder layer's keys and the MTP projections, which transformers ignores).
Presets with a vision encoder (``VISION_PRESETS``: tiny, small) also get config.json's
``vision`` section and ``vision/model.safetensors`` (`engine.model.vision`); the subfolder
keeps those tensors out of the language model's shards, quantisation and loaders.

Every tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's
values do not depend on which other tensors exist, and the file is written one tensor at a
time (flash-shape never holds more than one tensor in memory). The parameters transformers
initialises to zero (attention sinks, compressor ``position_bias``, the MoE correction
bias, the hash-MoE ``tid2eid`` table) are randomised, since zeros hide bugs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.presets import VISION_PRESETS, preset_config
from engine.checkpoint.quant import QUANT_MODES, quantize_checkpoint
from engine.checkpoint.safetensors_stream import TensorPlan, write_streaming
from engine.checkpoint.tokenizer import write_tokenizer

SHARD_BYTES = 4 * 1024**3
# Modules transformers keeps in fp32 whatever the checkpoint dtype (its _keep_in_fp32_modules_strict).
_FP32_PARTS = (
    "attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias",
    "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "norm.", "enorm", "hnorm",
)  # fmt: skip


@dataclass(frozen=True)
class GeneratedCheckpoint:
    path: Path
    num_parameters: int
    num_bytes: int
    files: tuple[str, ...]  # the language model's shards
    vision_files: tuple[str, ...] = ()  # the vision encoder's weights, if any


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _plan_shapes(config: dict[str, Any]) -> list[TensorPlan]:
    """Names, shapes and dtypes of every tensor, read off transformers' model built on `meta`."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_config = DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("model_type", "dtype")})
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_config)
    state = model.state_dict()
    dtype = getattr(torch, config["dtype"])
    plans = [TensorPlan(n, tuple(t.shape), stored_dtype(n, t.dtype, dtype)) for n, t in state.items()]
    # One MTP layer: the keys of a decoder layer (the last one's shapes: top-k MoE) plus its projections.
    last = hf_config.num_hidden_layers - 1
    prefix = f"model.layers.{last}."
    for name, t in state.items():
        if name.startswith(prefix):
            mtp_name = "mtp.0." + name[len(prefix) :]
            plans.append(TensorPlan(mtp_name, tuple(t.shape), stored_dtype(mtp_name, t.dtype, dtype)))
    hidden, hc = hf_config.hidden_size, hf_config.hc_mult
    for name, shape in (
        ("mtp.0.e_proj.weight", (hidden, hidden)),
        ("mtp.0.h_proj.weight", (hidden, hidden)),
        ("mtp.0.enorm.weight", (hidden,)),
        ("mtp.0.hnorm.weight", (hidden,)),
        ("mtp.0.norm.weight", (hidden,)),
        ("mtp.0.hc_head.hc_fn", (hc, hc * hidden)),
        ("mtp.0.hc_head.hc_base", (hc,)),
        ("mtp.0.hc_head.hc_scale", (1,)),
    ):
        plans.append(TensorPlan(name, shape, stored_dtype(name, torch.float32, dtype)))
    return plans


def stored_dtype(name: str, native: torch.dtype, target: torch.dtype) -> torch.dtype:
    """The dtype a tensor is stored in: integers as they are, transformers' fp32 modules fp32, else ``target``."""
    if not native.is_floating_point:
        return native
    if any(part in name for part in _FP32_PARTS):
        return torch.float32
    return target


_BLOCK_ELEMENTS = 1 << 24  # values drawn per row block: bounds memory for any tensor size


def _produce(plan: TensorPlan, seed: int, config: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Yield the tensor in row blocks; each block has its own generator (seed, name, block)."""
    shape = plan.shape
    if len(shape) < 2:
        yield _draw(plan, shape, torch.Generator().manual_seed(_seed_for(seed, plan.name)), config)
        return
    row = math.prod(shape[1:])
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(row, 1))
    for i, start in enumerate(range(0, shape[0], rows_per_block)):
        rows = min(rows_per_block, shape[0] - start)
        gen = torch.Generator().manual_seed(_seed_for(seed, f"{plan.name}#{i}"))
        yield _draw(plan, (rows, *shape[1:]), gen, config)


def _draw(
    plan: TensorPlan, shape: tuple[int, ...], gen: torch.Generator, config: dict[str, Any]
) -> torch.Tensor:
    name = plan.name
    if name.endswith("tid2eid"):  # distinct experts per token id
        n_experts = int(config["n_routed_experts"])
        rows = torch.rand(shape[0], n_experts, generator=gen).argsort(dim=1)[:, : shape[1]]
        return rows.to(plan.dtype)
    if name.endswith(("sinks", "position_bias")):
        values = torch.randn(shape, generator=gen)
    elif name.endswith("e_score_correction_bias"):
        values = 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith(("hc_base", ".base")):
        values = 0.5 * torch.randn(shape, generator=gen)
    elif name.endswith(("hc_scale", ".scale")):
        values = 0.5 + torch.rand(shape, generator=gen)
    elif "norm" in name and len(shape) == 1:
        values = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        values = torch.randn(shape, generator=gen)
    else:  # projections: unit-variance outputs, whatever the fan-in
        values = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return values.to(plan.dtype)


def _shard(plans: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.nbytes
    return shards


def _write_vision(
    out: Path, preset: str, seed: int, config: dict[str, Any]
) -> tuple[dict[str, Any], int, int]:
    """Random vision-encoder weights for ``preset`` -> (config section, parameters, bytes).

    Each tensor has its own generator seeded by (seed, name), like the language model's.
    """
    from engine.model.vision import VISION_PREFIX, VISION_WEIGHTS, VisionConfig, VisionEncoder, random_init

    vcfg = VisionConfig(**VISION_PRESETS[preset], text_hidden_size=int(config["hidden_size"]))
    with torch.device("meta"):
        state = VisionEncoder(vcfg).state_dict()
    dtype = getattr(torch, config["dtype"])
    plans = [TensorPlan(VISION_PREFIX + n, tuple(t.shape), dtype) for n, t in state.items()]

    def produce(plan: TensorPlan) -> Iterator[torch.Tensor]:
        gen = torch.Generator().manual_seed(_seed_for(seed, plan.name))
        yield random_init(plan.name.removeprefix(VISION_PREFIX), plan.shape, gen).to(plan.dtype)

    path = out / VISION_WEIGHTS
    path.parent.mkdir(parents=True, exist_ok=True)
    write_streaming(path, plans, produce)
    return vcfg.to_dict(), sum(math.prod(p.shape) for p in plans), path.stat().st_size


def _config_and_tokenizer(preset: str, out: Path, overrides: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``preset``'s config (with ``overrides``) and its tokenizer, written into ``out``; the
    config's vocabulary and special ids are the tokenizer's."""
    out.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset, **overrides)
    vocab_limit = None if int(config["vocab_size"]) >= 129280 else int(config["vocab_size"])
    tok = write_tokenizer(out, vocab_limit=vocab_limit)
    config.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return config, tok


def _write_configs(out: Path, config: dict[str, Any], tok: Any) -> None:
    """config.json and generation_config.json (greedy by default, the tokenizer's ids)."""
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))


def write_config_dir(preset: str, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
    """``preset``'s config.json, generation config and tokenizer in ``out_dir``, with no
    weights: a model directory for ``EngineConfig(random_weights=seed)``, which builds the
    weights on the device (flash-shape widths hold ~13 GB of experts per layer)."""
    out = Path(out_dir)
    config, tok = _config_and_tokenizer(preset, out, overrides)
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    config["sluice"] = {"preset": preset, "seed": seed, "weights": "random, built on the device"}
    _write_configs(out, config, tok)
    return out


def generate_checkpoint(
    preset: str,
    out_dir: Path | str,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    quant: str | None = None,
    vision: bool = True,
    **overrides: Any,
) -> GeneratedCheckpoint:
    """Write a random checkpoint of ``preset`` (with config ``overrides``) into ``out_dir``.

    ``quant="fp8"`` stores the linears (and experts) as FP8 e4m3 with 128x128 ue8m0 block
    scales, ``quant="fp4"`` additionally stores the routed experts as packed FP4 e2m1 with one
    ue8m0 scale per 32 values (DeepSeek's released formats, `engine.checkpoint.quant`).
    ``vision`` writes the preset's vision encoder (if ``VISION_PRESETS`` has one; never
    quantised); ``vision=False`` leaves it out.
    """
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"unknown quant {quant!r}; known: {', '.join(QUANT_MODES)}")
    out = Path(out_dir)
    config, tok = _config_and_tokenizer(preset, out, overrides)
    plans = _plan_shapes(config)
    shards = _shard(plans, shard_bytes)
    files = []
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        write_streaming(out / fname, shard, lambda p: _produce(p, seed, config))
        files.append(fname)
        weight_map.update({p.name: fname for p in shard})
    total = sum(p.nbytes for p in plans)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    config["sluice"] = {"preset": preset, "seed": seed}
    vision_files: tuple[str, ...] = ()
    vision_params = vision_bytes = 0
    if vision and preset in VISION_PRESETS:
        from engine.model.vision import VISION_WEIGHTS

        config["vision"], vision_params, vision_bytes = _write_vision(out, preset, seed, config)
        vision_files = (VISION_WEIGHTS,)
    _write_configs(out, config, tok)
    n_params = sum(math.prod(p.shape) for p in plans)
    if quant is not None:
        quantize_checkpoint(out, out, quant)
        total = sum((out / f).stat().st_size for f in files)
    return GeneratedCheckpoint(
        out, n_params + vision_params, total + vision_bytes, tuple(files), vision_files
    )
