"""RMSNorms: weighted (fp32 weight, fp32 math) and unweighted (per-head query norm, hc input norm).

Both use ``F.rms_norm`` (one fused kernel on CUDA) wherever its rounding is the reference's:
fp32 math throughout. An unweighted norm of a bf16 tensor keeps the reference's order (the
scale cast to the tensor's dtype, then the product in that dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import rowwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and rowwise.usable(x, self.weight) and x.shape[-1] <= 8192:
            return rowwise.rms_weighted(x, self.weight, self.eps)  # one pass, no fp32 copy
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    if rowwise.usable(x) and x.shape[-1] <= 8192:  # one pass, the same order of roundings
        return rowwise.rms_unweighted(x, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
