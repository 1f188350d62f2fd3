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


def _streams(t: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(t, 4, 4096, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.randn(t, 4096, device="cuda", generator=g).to(torch.bfloat16)
    pre = torch.rand(t, 4, device="cuda", generator=g)
    post = 2 * torch.rand(t, 4, device="cuda", generator=g)
    comb = torch.softmax(torch.randn(t, 4, 4, device="cuda", generator=g), dim=-1)
    return s, out, pre, post, comb


@pytest.mark.parametrize("t", [1, 7, 4096])
def test_mhc_kernels_match_the_eager_mixes(t: int) -> None:
    """engine/kernels/hyper.py against the eager collapse and merge (flash-shape widths, bf16)."""
    from engine.kernels import hyper as hk

    s, out, pre, post, comb = _streams(t)
    assert hk.usable(s)
    want_c = (pre.unsqueeze(-1) * s).sum(dim=1).to(s.dtype)
    want_m = post.to(s.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(s.dtype).transpose(-1, -2), s
    )
    got_c, got_m = hk.collapse(s, pre), hk.merge(s, out, post, comb)
    torch.testing.assert_close(got_c, want_c, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(
        got_m, want_m, rtol=1.6e-2, atol=1e-2
    )  # one bf16 ulp: cuBLAS sums in its own order
    print(
        f"T={t}: bitwise equal: collapse {(got_c == want_c).float().mean().item():.4f}, "
        f"merge {(got_m == want_m).float().mean().item():.4f}"
    )


def test_mhc_kernels_are_batch_invariant() -> None:
    from engine.kernels import hyper as hk

    s, out, pre, post, comb = _streams(200, seed=1)
    c, m = hk.collapse(s, pre), hk.merge(s, out, post, comb)
    for i in (0, 57, 199):
        sl = slice(i, i + 1)
        assert torch.equal(hk.collapse(s[sl], pre[sl]), c[sl])
        assert torch.equal(hk.merge(s[sl], out[sl], post[sl], comb[sl]), m[sl])


def test_the_query_norm_kernel_matches_the_eager_norm() -> None:
    """engine/kernels/rowwise.py's unweighted RMS norm against the eager one (bf16, 64 x 512 heads)."""
    from engine.kernels import rowwise

    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(4096, 64, 512, device="cuda", generator=g) * 3).to(torch.bfloat16)
    want = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)
    got = rowwise.rms_unweighted(x, 1e-6)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=0)  # one bf16 ulp: the mean's order
    print(f"query norm: bitwise equal {(got == want).float().mean().item():.4f}")
    assert torch.equal(rowwise.rms_unweighted(x[:7], 1e-6), got[:7])


def test_the_combine_kernel_matches_the_eager_combine() -> None:
    """Expert outputs summed from expert-major rows: within a bf16 ulp of the eager scatter +
    fp32 sum (torch sums k in its own order), and bitwise what `moe.combine` gives on CUDA from
    token-major rows (the expert-parallel path's), so one rank and EP ranks still agree."""
    from engine.kernels import rowwise
    from engine.model.moe import combine

    g = torch.Generator(device="cuda").manual_seed(3)
    n, k = 4096, 6
    y = torch.randn(n * k, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(n, k, device="cuda", generator=g)
    order = torch.randperm(n * k, device="cuda", generator=g)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n * k, device="cuda")
    got = rowwise.combine(y[order], inverse, w, torch.bfloat16)
    assert torch.equal(got, combine(y, w, torch.bfloat16))
    want = (y.view(n, k, -1).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-6)
    print(f"combine: bitwise equal to torch's sum {(got == want).float().mean().item():.4f}")
