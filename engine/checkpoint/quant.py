"""DeepSeek's released weight formats: FP8 block-scaled linears and FP4 experts.

- FP8: ``X.weight`` float8_e4m3fn ``[out, in]`` with ``X.weight_scale_inv`` (or ``X.scale``)
  ``[ceil(out/128), ceil(in/128)]``, fp32 or ue8m0 (``float8_e8m0fnu``, a power of two);
  real = q * scale over each 128x128 block.
- FP4 (e2m1) experts: ``int8`` with two codes per byte (even element in the low nibble), the
  last dim halved, scales ``[..., out, in/32]`` (ue8m0 or fp32), one per 32 values of a row.
  Packed transformers keys (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale_inv``) and
  DeepSeek's per-expert keys (``experts.3.w1.weight`` + ``experts.3.w1.scale``) are both read.

The loader dequantises on the CPU (``dequantize``); ``quantize_fp8`` / ``quantize_fp4`` make
the tiny quantised test checkpoints (`quantize_checkpoint`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
QUANT_MODES = ("fp8", "fp4")


def is_scale_key(src, key: str) -> bool:
    """A quantisation scale (``X.weight_scale_inv``, ``X_scale_inv`` or ``X.scale`` beside ``X.weight``)."""
    if key.endswith("_scale_inv"):
        return True
    return key.endswith(".scale") and key.removesuffix("scale") + "weight" in src


def find_scale(src, key: str) -> str | None:
    for cand in (key + "_scale_inv", key.removesuffix("weight") + "scale"):
        if cand != key and cand in src:
            return cand
    return None


def scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponent bytes or float scales -> fp32."""
    if scale.dtype == torch.uint8:  # raw e8m0 exponent bytes
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    vals = torch.stack([lut[(u8 & 0xF).long()], lut[((u8 >> 4) & 0xF).long()]], dim=-1)
    return vals.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 (128x128 blocks) or packed FP4 (1x32 groups) -> fp32, leading dims (experts) kept."""
    if q.dtype in (torch.int8, torch.uint8):
        w, block = _unpack_fp4(q), (1, FP4_GROUP)
    elif q.dtype == torch.float8_e4m3fn:
        w, block = q.to(torch.float32), (FP8_BLOCK, FP8_BLOCK)
    else:
        raise ValueError(
            f"a scale was given for a {q.dtype} tensor; expected float8_e4m3fn or packed FP4 int8"
        )
    s = scales_fp32(scale)
    rows, cols = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    if s.shape != w.shape:
        raise ValueError(
            f"scale grid {tuple(scale.shape)} does not cover weight {tuple(w.shape)} in {block} blocks"
        )
    return w * s


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0**-126))))


def quantize_fp8(w: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (float8_e4m3fn weight, scale [..., ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape[-2:]
    pr, pc = -rows % FP8_BLOCK, -cols % FP8_BLOCK
    wp = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    lead = wp.shape[:-2]
    blocks = wp.reshape(*lead, wp.shape[-2] // FP8_BLOCK, FP8_BLOCK, wp.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale = amax.clamp(min=1e-12) / FP8_MAX
    if ue8m0:
        scale = _pow2_ceil(scale)
    full = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :rows, :cols]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] (in % 32 == 0) -> (int8 packed e2m1 [..., out, in/2], ue8m0 scale [..., out, in/32])."""
    rows, cols = w.shape[-2:]
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 needs the input dim ({cols}) to be a multiple of {FP4_GROUP}")
    g = w.float().reshape(*w.shape[:-1], cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_ceil(g.abs().amax(-1).clamp(min=1e-12) / FP4_MAX)  # [..., out, in/32]
    x = (g / scale.unsqueeze(-1)).reshape(w.shape)
    lut = torch.tensor(_E2M1[:8], device=w.device)
    mag = (x.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # nearest magnitude code 0..7
    code = (mag + 8 * (x < 0).long()).to(torch.uint8)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def fp8_target(name: str, t: torch.Tensor) -> bool:
    """Linears DeepSeek ships in FP8: attention/shared-expert/MTP projections; not embeddings, head,
    norms, router, hc params, or the compressor/indexer kv/gate/weights projections (BF16 there)."""
    if t.dim() != 2 or not name.endswith(".weight") or "norm" in name:
        return False
    skip = (
        "embed",
        "head.weight",
        ".gate.weight",
        "compressor.wkv",
        "compressor.wgate",
        "compressor.kv_proj",
        "compressor.gate_proj",
        "weights_proj",
        "indexer.kv_proj",
        "indexer.gate_proj",
    )
    return not any(s in name for s in skip)


_EXPERT_KEY = re.compile(r"\.experts\.(\d+\.w[123]\.weight|gate_up_proj|down_proj)$")


def _is_expert(name: str) -> bool:
    return _EXPERT_KEY.search(name) is not None


def quantize_tensors(
    tensors: dict[str, torch.Tensor], mode: str, ue8m0: bool = True
) -> dict[str, torch.Tensor]:
    """Quantise a checkpoint's tensors: ``fp8`` = FP8 linears and experts; ``fp4`` = FP8 linears + FP4 experts."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quant mode {mode!r}; known: {QUANT_MODES}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        expert = _is_expert(name)
        if expert and mode == "fp4":
            q, s = quantize_fp4(t)
            out[name] = q
            out[
                name.removesuffix("weight") + "scale" if name.endswith(".weight") else name + "_scale_inv"
            ] = s
        elif expert or fp8_target(name, t):
            q, s = quantize_fp8(t, ue8m0)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    return out


def quantize_checkpoint(src: str | Path, dst: str | Path, mode: str, ue8m0: bool = True) -> Path:
    """Write a quantised copy of a safetensors checkpoint directory (``dst`` may be ``src``).

    The config gains a ``quantization_config``; a shard index gains the new scale keys.
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors = {k: h.get_tensor(k).clone() for k in h.keys()}  # noqa: SIM118
        out = {k: v.contiguous() for k, v in quantize_tensors(tensors, mode, ue8m0).items()}
        save_file(out, str(dst / f.name))
        weight_map.update({k: f.name for k in out})
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta["weight_map"] = weight_map
        (dst / index.name).write_text(json.dumps(meta, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "scale_fmt": "ue8m0" if ue8m0 else "float",
        "expert_dtype": mode,
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if src.resolve() != dst.resolve():
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if (src / extra).exists():
                shutil.copy(src / extra, dst / extra)
    return dst


def fake_quantize(t: torch.Tensor, name: str, mode: str, ue8m0: bool = True) -> torch.Tensor:
    """What the loader will see for ``name`` after a round trip through ``mode`` (for reference models)."""
    q = quantize_tensors({name: t}, mode, ue8m0)
    if len(q) == 1:
        return t
    scale_key = next(k for k in q if k != name)
    return dequantize(q[name], q[scale_key]).to(t.dtype)


__all__ = [
    "QUANT_MODES",
    "dequantize",
    "fake_quantize",
    "quantize_checkpoint",
    "quantize_fp4",
    "quantize_fp8",
]
