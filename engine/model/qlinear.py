"""Weights kept in DeepSeek's quantised formats on the device (FP8 block-scaled, FP4 packed):
half (FP8) or a quarter (FP4) of the bf16 weight memory. FP8 times bf16 activations on CUDA
reads the FP8 weight in place (`engine.kernels.fp8`); elsewhere a weight is dequantised per use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.quant import dequantize
from engine.kernels import fp8


class QuantLinear(nn.Module):
    """A bias-free linear whose weight stays FP8 (or packed FP4) with its block scales."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fp8.usable(x, self.qweight):  # FP8 read in place, no dequantised copy
            return fp8.linear(x, self.qweight, self.scale)
        x = fp8.eager_input(x, self.qweight)  # w8a8's values, multiplied eagerly
        return F.linear(x, dequantize(self.qweight, self.scale).to(x.dtype))


def replace_linear(root: nn.Module, path: str, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Swap the nn.Linear at dotted ``path`` (under ``root``) for a QuantLinear with the same shape."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, leaf)
    if hasattr(old, "set_quantized"):  # GroupedLinear keeps its own quantised weight
        old.set_quantized(qweight, scale)
        return
    if not isinstance(old, nn.Linear) or old.bias is not None:
        raise ValueError(f"{path} is not a bias-free nn.Linear; cannot keep it quantised")
    new = QuantLinear(qweight, scale)
    if tuple(dequantize(qweight[:1], scale[:1]).shape[1:]) != (old.in_features,):
        raise ValueError(f"{path}: quantised weight does not match in_features={old.in_features}")
    setattr(parent, leaf, new)


def keep_fp8_(model: nn.Module) -> int:
    """Quantise ``model``'s weights to FP8 in place and keep them quantised, as loading an FP8
    checkpoint with ``keep_quantized`` leaves them: the linears DeepSeek ships in FP8
    (`engine.checkpoint.quant.fp8_target`) become `QuantLinear` (or a quantised
    `GroupedLinear`), the routed experts' projections FP8 with their block scales (one expert
    at a time: no fp32 copy of all of them). For models built with random weights on the
    device (`sluice bench engine --preset P --quant fp8`). Returns the tensors quantised."""
    from engine.checkpoint.quant import fp8_target, quantize_fp8
    from engine.model.experts import Experts

    done = 0
    with torch.no_grad():
        for name, mod in list(model.named_modules()):
            if isinstance(mod, Experts):
                for which in ("gate_up_proj", "down_proj"):
                    w = getattr(mod, which).data
                    parts = [quantize_fp8(w[e]) for e in range(w.shape[0])]
                    mod.set_quantized(
                        which, torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
                    )
                    done += 1
            elif hasattr(mod, "set_quantized") or (isinstance(mod, nn.Linear) and mod.bias is None):
                w = getattr(mod, "weight", None)
                if (
                    isinstance(w, torch.Tensor)
                    and w.dim() == 2
                    and w.numel()
                    and fp8_target(f"{name}.weight", w)
                ):
                    q, s = quantize_fp8(w.data)
                    replace_linear(model, name, q, s)
                    done += 1
    return done


def graph_safe(model: nn.Module) -> bool:
    """Whether ``model``'s quantised weights (if any) leave a decode step capturable as a CUDA
    graph: routed experts either not quantised or FP8 in both projections read by the FP8
    kernels (the per-expert loop of other formats waits on the host)."""
    from engine.kernels import kernels_on
    from engine.model.experts import Experts

    for mod in model.modules():
        if isinstance(mod, Experts) and mod.quantized:
            fp8_both = mod.quantized == {"gate_up_proj", "down_proj"} and all(
                getattr(mod, f"{w}_q").dtype == torch.float8_e4m3fn for w in mod.quantized
            )
            if not (fp8_both and kernels_on()):
                return False
    return True
