"""The CPU's small Sinkhorn in numpy is bitwise the torch loop it replaces."""

from __future__ import annotations

import pytest
import torch

from engine.model import hyper
from engine.model.hyper import NUMPY_SINKHORN_ELEMENTS, _sinkhorn_numpy, sinkhorn_eager


def _torch_loop(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_numpy_sinkhorn_is_bitwise_the_torch_loop(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    for scale in (1.0, 30.0):  # near-uniform and peaked softmaxes, as trained comb weights are
        comb = torch.softmax(torch.randn(rows, 4, 4, generator=g) * scale, dim=-1) + 1e-6
        want = _torch_loop(comb, 20, 1e-6)
        assert torch.equal(_sinkhorn_numpy(comb, 20, 1e-6), want)
        assert torch.equal(sinkhorn_eager(comb, 20, 1e-6), want)
        assert comb.numel() <= NUMPY_SINKHORN_ELEMENTS


def test_large_batches_and_autograd_keep_the_torch_loop(monkeypatch) -> None:
    monkeypatch.setattr(hyper, "_sinkhorn_numpy", lambda *a: pytest.fail("numpy path taken"))
    big = torch.softmax(torch.randn(NUMPY_SINKHORN_ELEMENTS // 16 + 1, 4, 4), dim=-1) + 1e-6
    assert torch.equal(sinkhorn_eager(big, 20, 1e-6), _torch_loop(big, 20, 1e-6))
    small = (torch.softmax(torch.randn(2, 4, 4), dim=-1) + 1e-6).requires_grad_()
    sinkhorn_eager(small, 20, 1e-6).sum().backward()  # training: torch, with its backward
    assert small.grad is not None
