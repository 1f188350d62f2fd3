"""The Triton kernels against the eager code they replace (engine/kernels)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import sinkhorn as sk
from engine.model.hyper import sinkhorn_eager


def _comb(t: int, n: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, n, n, device="cuda", generator=g) * 3
    return torch.softmax(logits, dim=-1) + 1e-6


@pytest.mark.parametrize("t", [1, 7, 64, 1000])
def test_sinkhorn_kernel_equals_the_eager_loop(t: int) -> None:
    comb = _comb(t)
    assert sk.usable(comb)
    got, want = sk.sinkhorn(comb, 20, 1e-6), sinkhorn_eager(comb, 20, 1e-6)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    exact = (got == want).float().mean().item()
    print(f"T={t}: bitwise equal entries {exact:.4f}, max |diff| {(got - want).abs().max().item():.3g}")


def test_sinkhorn_kernel_is_batch_invariant() -> None:
    comb = _comb(200, seed=1)
    together = sk.sinkhorn(comb, 20, 1e-6)
    for i in (0, 57, 199):
        alone = sk.sinkhorn(comb[i : i + 1], 20, 1e-6)
        assert torch.equal(alone[0], together[i])
    assert torch.equal(sk.sinkhorn(comb[:7], 20, 1e-6), together[:7])
