"""Manifold-constrained hyper-connections (mHC): pre/post/comb weights with Sinkhorn, and the hc head."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kernels import hyper as hyper_kernel
from engine.kernels import sinkhorn as sinkhorn_kernel
from engine.kernels import tracks_grad
from engine.model.norms import rms_unweighted


class HyperConnection(nn.Module):
    """Weights for one block: collapse the hc streams (pre), expand the output (post), mix (comb)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n = n
        self.iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> post [T, n], comb [T, n, n] (fp32), collapsed [T, D]."""
        n = self.n
        if hyper_kernel.usable(streams, self.fn, self.base, self.scale):  # two launches for all of it
            pre, post, comb = hyper_kernel.hc_weights(
                streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters
            )
            return post, comb, hc_collapse(streams, pre)
        mixes = hc_mixes(streams, self.fn, self.norm_eps)  # [T, (2+n)*n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        if sinkhorn_kernel.usable(comb):
            comb = sinkhorn_kernel.sinkhorn(comb, self.iters, self.hc_eps)
        else:
            comb = sinkhorn_eager(comb, self.iters, self.hc_eps)
        return post, comb, hc_collapse(streams, pre)


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The mixing weights' projection: the RMS-normalised flattened streams [T, n*D] times
    fn^T, in fp32. streams [T, n, D], fn [M, n*D] -> [T, M]."""
    if hyper_kernel.usable(streams, fn):
        return hyper_kernel.premix(streams, fn, eps)
    return F.linear(rms_unweighted(streams.flatten(1).float(), eps), fn.float())


#: at most this many elements, the CPU's Sinkhorn runs in numpy (`_sinkhorn_numpy`): ~120
#: operations on a few hundred numbers cost torch ~2 us each and numpy less than 1. The
#: crossover measured by `sluice bench hyper --device cpu` on the 2-core VM (4 x 4 matrices, 20
#: iterations): numpy 113 against torch 254 us at 1 row, 353 against 378 at 64, 489 against
#: 459 at 96 (docs/engine.md, "mHC's Sinkhorn on the CPU").
NUMPY_SINKHORN_ELEMENTS = 1024


def sinkhorn_eager(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn normalisation of ``comb`` [T, n, n]: columns, then ``iters - 1`` rounds of
    rows and columns, each divided by its sum + eps (transformers' order)."""
    if (
        comb.device.type == "cpu"
        and comb.dtype == torch.float32
        and comb.numel() <= NUMPY_SINKHORN_ELEMENTS
        and not tracks_grad(comb)
    ):
        return _sinkhorn_numpy(comb, iters, eps)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _sinkhorn_numpy(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_eager` in numpy, in place on a copy: the same operations in the same order
    (each sum over 4 elements accumulated in order, the fp32 eps added, one division), so
    bitwise the torch loop's result (`tests/unit/engine/test_hyper_numpy.py`)."""
    c = comb.detach().numpy().copy()
    e = np.float32(eps)
    c /= c.sum(axis=-2, keepdims=True) + e
    for _ in range(iters - 1):
        c /= c.sum(axis=-1, keepdims=True) + e
        c /= c.sum(axis=-2, keepdims=True) + e
    return torch.from_numpy(c)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre[j] * x[j] in fp32, in the streams' dtype. streams [T, n, D], pre [T, n] (fp32)."""
    if hyper_kernel.usable(streams, pre):
        return hyper_kernel.collapse(streams, pre)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_merge(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """x' = post * out + comb^T @ x (comb is consumed transposed). streams [T, n, D], out [T, D]."""
    if hyper_kernel.usable(streams, out, post, comb):
        return hyper_kernel.merge(streams, out, post, comb)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """Final collapse of the hc streams (sigmoid weights) before the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, D] -> [T, D]."""
        mixes = hc_mixes(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return hc_collapse(streams, pre)
