"""Weights kept in DeepSeek's quantised formats on the device (FP8 block-scaled, FP4 packed),
dequantised per use: half (FP8) or a quarter (FP4) of the bf16 weight memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.quant import dequantize


class QuantLinear(nn.Module):
    """A bias-free linear whose weight stays FP8 (or packed FP4) with its block scales."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
