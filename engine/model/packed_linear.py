"""A linear layer that runs through oneDNN on the CPU with its weight packed once.

torch's `F.linear` on the CPU calls MKL's sgemm, which is slow for the shapes of a decode
step's output head: a few rows against a very wide weight. On this project's 2-core VM the
`small` preset's `lm_head` ([16, 256] x [256, 129,280] in fp32, 132 MB of weight) took
24-27 ms through `F.linear`, while reading those 132 MB takes ~3.5 ms; through oneDNN with
the weight reordered once into oneDNN's blocked layout it took 7.6-8.3 ms (5.4 ms at one row,
against 16.9). The ops are torch's own (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`, what torch.compile's CPU backend emits for a linear whose weight does not
change), so nothing beyond torch is needed.

The packed copy is kept beside the weight and rebuilt whenever the weight is another tensor
or was written in place (its version counter), so loading, moving or editing the weight never
leaves a stale copy. It costs a second copy of the weight in host memory (132 MB for the
`small` preset's head). Off the CPU, in other dtypes, under autograd (training), for a
weight made under `torch.inference_mode` (whose in-place writes no counter records), or with
`PACKED = False`, the layer is `nn.Linear`. The sums run in another order than MKL's: the
head's logits differ from `F.linear`'s by fp32 rounding (~3e-6 relative).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import tracks_grad

#: process-wide switch (`sluice bench engine --cpu-head torch` sets it off for an A/B)
PACKED = True


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and its packed-linear ops."""
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) that takes oneDNN's packed path for fp32
    inputs on the CPU outside autograd (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
        return self._packed[1]

    def uses_packed(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            PACKED
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and w.dtype == torch.float32
            and w.device.type == "cpu"
            and not w.is_inference()  # built under inference_mode: no version counter to trust
            and not tracks_grad(x, w)
            and available()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_packed(x):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed_weight(), bias, "none", [], "")
