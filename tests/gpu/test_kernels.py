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


@pytest.mark.parametrize("t", [1, 7, 4096])
@pytest.mark.parametrize("m", [24, 4])  # a block's pre/post/comb projection; the head's
def test_the_premix_kernel_matches_the_eager_projection(t: int, m: int) -> None:
    """engine/kernels/hyper.py's premix against the eager fp32 norm + matmul (flash widths)."""
    import torch.nn.functional as F

    from engine.kernels import hyper as hk
    from engine.model.norms import rms_unweighted

    s = _streams(t)[0]
    g = torch.Generator(device="cuda").manual_seed(4)
    fn = torch.randn(m, 4 * 4096, device="cuda", generator=g) * 0.02
    want = F.linear(rms_unweighted(s.flatten(1).float(), 1e-6), fn)
    got = hk.premix(s, fn, 1e-6)
    assert got.dtype == torch.float32 and got.shape == (t, m)
    # fp32 sums of 16,384 products in another order: a few fp32 ulps of the sum's magnitude
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print(f"premix T={t} M={m}: max |diff| {(got - want).abs().max().item():.3g}")


def test_the_premix_kernel_is_batch_invariant() -> None:
    from engine.kernels import hyper as hk

    s = _streams(200, seed=1)[0]
    fn = torch.randn(24, 4 * 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    together = hk.premix(s, fn, 1e-6)
    for i in (0, 57, 199):
        assert torch.equal(hk.premix(s[i : i + 1], fn, 1e-6)[0], together[i])
    assert torch.equal(hk.premix(s[:7], fn, 1e-6), together[:7])


def test_the_swiglu_kernel_matches_the_eager_activation() -> None:
    """rowwise.swiglu on the gate and up halves of one projection, in place: the eager code's
    roundings (bitwise but where the exponential's last fp32 bit differs)."""
    import torch.nn.functional as F

    from engine.kernels import rowwise

    g = torch.Generator(device="cuda").manual_seed(6)
    h = (torch.randn(4096, 2 * 2048, device="cuda", generator=g) * 6).to(torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    want = F.silu(gate.clamp(max=10.0)) * up.clamp(min=-10.0, max=10.0)
    got = rowwise.swiglu(gate, up, 10.0)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-6)
    exact = (got == want).float().mean().item()
    print(f"swiglu: bitwise equal {exact:.5f}")
    assert exact > 0.99
    assert torch.equal(rowwise.swiglu(gate[:7], up[:7], 10.0), got[:7])


@pytest.mark.parametrize("inverse", [False, True])
def test_the_rope_kernel_matches_the_eager_rotation(inverse: bool) -> None:
    """engine/kernels/rope.py on queries [T, 64, 512] (and a strided [T, 512] view, as a
    latent's slice is) against the eager rotation, bitwise but for fp32 contraction."""
    from engine.config import RopeConfig
    from engine.kernels import rope as rk
    from engine.kernels import set_kernels
    from engine.model.rope import Rotary

    rot = Rotary(RopeConfig(theta=10000.0, rope_dim=64, factor=None)).cuda()
    g = torch.Generator(device="cuda").manual_seed(7)
    pos = torch.randint(0, 1 << 20, (4096,), device="cuda", generator=g)
    wide = torch.randn(4096, 600, device="cuda", generator=g).to(torch.bfloat16)
    for x in (torch.randn(4096, 64, 512, device="cuda", generator=g).to(torch.bfloat16), wide[:, 40:552]):
        assert rk.usable(x, 64)
        set_kernels(False)
        try:
            want = rot(x.clone(), pos, inverse=inverse)
        finally:
            set_kernels(True)
        before = wide.clone()
        got = rot(x.clone() if x.is_contiguous() else x, pos, inverse=inverse)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-6)
        exact = (got == want).float().mean().item()
        print(f"rope {tuple(x.shape)} inverse={inverse}: bitwise equal {exact:.5f}")
        assert exact > 0.99
        if not x.is_contiguous():  # only the view's rotated channels were written
            assert torch.equal(wide[:, :488], before[:, :488]) and torch.equal(wide[:, 552:], before[:, 552:])


def test_the_index_dots_on_tensor_cores_equal_fp32() -> None:
    """The indexer's q . k in bf16 with fp32 output (`compressor._dots`) against the fp32
    einsum: exact products, fp32 sums, so equal up to the order of the sums."""
    from engine.kernels import set_kernels
    from engine.model.compressor import _dots

    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(512, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    keys = torch.randn(1024, 128, device="cuda", generator=g).to(torch.bfloat16)
    per_row = torch.randn(16, 300, 128, device="cuda", generator=g).to(torch.bfloat16)
    for k, qq in ((keys, q), (per_row, q[:16])):
        got = _dots(qq, k)
        set_kernels(False)
        try:
            want = _dots(qq, k)
        finally:
            set_kernels(True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_weighted_norm_kernel_matches_the_eager_norm() -> None:
    """rowwise.rms_weighted against `RMSNorm`'s eager fp32 copy, norm and copy back (bf16)."""
    import torch.nn.functional as F

    from engine.kernels import rowwise

    g = torch.Generator(device="cuda").manual_seed(9)
    for d in (512, 1024, 4096):
        x = (torch.randn(4096, d, device="cuda", generator=g) * 3).to(torch.bfloat16)
        w = torch.rand(d, device="cuda", generator=g) + 0.5
        want = F.rms_norm(x.float(), (d,), w, 1e-6).to(x.dtype)
        got = rowwise.rms_weighted(x, w, 1e-6)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=0)  # one bf16 ulp: the mean's order
        print(f"weighted norm D={d}: bitwise equal {(got == want).float().mean().item():.4f}")
        assert torch.equal(rowwise.rms_weighted(x[:7], w, 1e-6), got[:7])


def test_the_index_reduce_kernel_matches_the_eager_sum() -> None:
    """rowwise.index_reduce (the CSA indexer's head-weighted ReLU sum) against the eager one;
    a row's sum is the same in any batch."""
    from engine.kernels import rowwise

    g = torch.Generator(device="cuda").manual_seed(10)
    dots = torch.randn(512, 64, 1000, device="cuda", generator=g)
    w = torch.rand(512, 64, device="cuda", generator=g)
    want = (torch.relu(dots) * w.unsqueeze(-1)).sum(1)
    got = rowwise.index_reduce(dots, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(rowwise.index_reduce(dots[5:6], w[5:6])[0], got[5])


def test_the_fused_index_scores_match_the_products_then_the_reduce() -> None:
    """rowwise.index_scores (the indexer's products, ReLU and head sum in one kernel) against
    the tensor-core products then `index_reduce`: the same exact products and head order,
    the products' own sums in another order; a row's scores are the same in any batch and
    any slice of the entries; uneven sizes (rows and entries not whole tiles)."""
    from engine.kernels import rowwise
    from engine.model.compressor import _dots

    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(1000, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    keys = torch.randn(1500, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(1000, 64, device="cuda", generator=g)
    want = rowwise.index_reduce(_dots(q, keys), w)
    got = rowwise.index_scores(q, w, keys)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    print(f"fused index scores: bitwise equal {(got == want).float().mean().item():.4f}")
    assert torch.equal(rowwise.index_scores(q[7:9], w[7:9], keys)[1], got[8])
    assert torch.equal(rowwise.index_scores(q, w, keys[300:700]), got[:, 300:700])


@pytest.mark.parametrize("overlap, rate", [(True, 4), (False, 128)])
def test_the_pooling_kernel_matches_the_eager_pooling(overlap: bool, rate: int) -> None:
    """engine.kernels.pooling against `Compressor._pool` in bf16 at flash widths (CSA: rate 4,
    overlapping; HCA: rate 128), from window 0 and from a later one: within a bf16 ulp (the
    sums' order), and each window the same computed alone."""
    from engine.kernels import pooling
    from engine.model.compressor import Compressor

    g = torch.Generator(device="cuda").manual_seed(12)
    d = 512
    comp = Compressor(64, d, rate, overlap, 1e-6).cuda()
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, device="cuda", generator=g))
    width = 2 * d if overlap else d
    for w0, nw in ((0, 4096 // rate), (7, 5)):
        lo = max(0, w0 * rate - (rate if overlap else 0))
        a = w0 * rate - lo
        length = a + nw * rate + 3
        kv = torch.randn(length, width, device="cuda", generator=g).to(torch.bfloat16)
        gate = (torch.randn(length, width, device="cuda", generator=g) * 3).to(torch.bfloat16)
        want = comp._pool(kv, gate, a, w0, nw)
        got = pooling.pool(kv, gate, comp.position_bias.detach(), a, w0, nw, rate, d, overlap)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-3)
        print(f"pooling overlap={overlap} w0={w0}: bitwise equal {(got == want).float().mean().item():.4f}")
        one = pooling.pool(kv, gate, comp.position_bias.detach(), a + rate, w0 + 1, 1, rate, d, overlap)
        assert torch.equal(one[0], got[1])


def test_the_grouped_output_projection_writes_its_groups_in_place() -> None:
    """GroupedLinear on CUDA (strided batches into [T, G, out]) against the einsum it
    replaces, flash widths in bf16."""
    from engine.model.attention import GroupedLinear

    g = torch.Generator(device="cuda").manual_seed(11)
    lin = GroupedLinear(4096, 8 * 1024, 8).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02, generator=g)
    x = torch.randn(4096, 8, 4096, device="cuda", generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got = lin(x)
        want = torch.einsum("tgi,goi->tgo", x, lin.weight.view(8, 1024, 4096)).flatten(1)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    print(f"grouped o_a: bitwise equal to the einsum {(got == want).float().mean().item():.4f}")


def _fp8_weights(e: int, n: int, k: int, seed: int):
    from engine.checkpoint.quant import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(e, n, k, device="cuda", generator=g) * 0.05
    parts = [quantize_fp8(w[i]) for i in range(e)]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def test_the_tuned_grouped_tiles_match_torchs_grouped_gemm() -> None:
    """engine/kernels/grouped.py's kernel with `TUNED_GROUPED` (128-row tiles,
    column tiles first) against torch's grouped GEMM: uneven groups, one past a row tile (two
    tiles), an empty one; widths not a whole column tile. bf16 products, fp32 sums in the same
    or another order: within bf16 rounding of the result. And which GEMM the experts take."""
    from engine.kernels import grouped
    from engine.model.experts import experts_gemm, torch_grouped_matmul, tuned_grouped_matmul

    g = torch.Generator(device="cuda").manual_seed(4)
    counts = torch.tensor([96, 0, 130, 57, 128, 1, 96, 300], device="cuda")
    ends = torch.cumsum(counts, 0).to(torch.int32)
    for n, k in ((4096, 4096), (4096, 2048), (200, 512)):
        w = torch.randn(8, n, k, device="cuda", generator=g).to(torch.bfloat16) * k**-0.5
        x = torch.randn(int(counts.sum()), k, device="cuda", generator=g).to(torch.bfloat16)
        got = grouped.grouped_matmul(x, w, ends, grouped.TUNED_GROUPED)
        want = torch_grouped_matmul(x, w, ends)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        print(f"tuned tiles N={n} K={k}: bitwise equal to torch {(got == want).float().mean().item():.4f}")
    rows = torch.zeros(256 * 400, 64, device="cuda", dtype=torch.bfloat16)
    assert experts_gemm(rows[: 256 * 96], 256) is tuned_grouped_matmul  # a 4,096-token prefill
    assert experts_gemm(rows[: 256 * 13], 256) is tuned_grouped_matmul
    assert experts_gemm(rows[: 256 * 4], 256) is grouped.grouped_matmul  # decode, 171 tokens
    assert experts_gemm(rows[:6], 256) is torch_grouped_matmul  # one token
    assert experts_gemm(rows, 256) is torch_grouped_matmul  # 400 rows per expert
    from engine.model.experts import force_experts_gemm

    try:  # what `sluice bench engine --experts-gemm` measures
        for kind, want in (
            ("torch", torch_grouped_matmul),
            ("fixed", grouped.grouped_matmul),
            ("tuned", tuned_grouped_matmul),
        ):
            force_experts_gemm(kind)
            assert experts_gemm(rows[:6], 256) is want and experts_gemm(rows, 256) is want
    finally:
        force_experts_gemm("auto")


def test_the_fp8_grouped_kernel_matches_dequantise_then_matmul() -> None:
    """engine/kernels/fp8.py: FP8 expert weights read in place against the dequantised copy's
    bf16 matmul (the same bf16 weight values; fp32 sums in another order), uneven groups and
    an empty one; a row's result is the same alone."""
    from engine.checkpoint.quant import dequantize
    from engine.kernels import fp8

    q, s = _fp8_weights(4, 4096, 1024, 12)
    counts = torch.tensor([100, 0, 7, 300], device="cuda")
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 1024, device="cuda").to(torch.bfloat16)
    got = fp8.grouped_matmul(x, q, s, ends)
    starts = [0, *ends.tolist()[:-1]]
    want = torch.cat(
        [
            x[a:b] @ dequantize(q[i], s[i]).to(torch.bfloat16).T
            for i, (a, b) in enumerate(zip(starts, ends.tolist()))
        ]
    )
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(fp8.grouped_matmul(x[105:106], q[2:3], s[2:3], ends.new_ones(1)), got[105:106])


def test_the_fp8_linear_matches_dequantise_then_matmul() -> None:
    from engine.checkpoint.quant import dequantize
    from engine.kernels import fp8

    q, s = _fp8_weights(1, 1536, 4096, 13)
    x = torch.randn(3, 77, 4096, device="cuda").to(torch.bfloat16)
    got = fp8.linear(x, q[0], s[0])
    want = x @ dequantize(q[0], s[0]).to(torch.bfloat16).T
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_the_row_quantiser_kernel_equals_its_reference() -> None:
    """engine/kernels/fp8.py `quantize_rows`: the same e4m3 bytes and scales as the eager rule,
    on rows of every magnitude, zero rows, and a strided input."""
    from engine.kernels import fp8

    g = torch.Generator(device="cuda").manual_seed(21)
    mags = torch.logspace(-6, 4, 1000, device="cuda")
    x = (torch.randn(1000, 4096, device="cuda", generator=g) * mags[:, None]).to(torch.bfloat16)
    x[7] = 0
    x[9, 200] = 3e4
    for rows in (x, x[:, :2048], x[::3]):
        q, s = fp8.quantize_rows(rows)
        rq, rs = fp8.quantize_rows_reference(rows)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_the_w8a8_grouped_kernel_matches_its_reference() -> None:
    """``w8a8``: FP8 weights times quantised activations on FP8 tensor cores against the
    same quantised values multiplied in fp32 (sums in another order), uneven groups and an
    empty one; a row's result is the same alone and in the batch."""
    from engine.checkpoint.quant import dequantize
    from engine.kernels import fp8

    q, s = _fp8_weights(4, 4096, 1024, 22)
    counts = torch.tensor([100, 0, 7, 300], device="cuda")
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 1024, device="cuda").to(torch.bfloat16)
    fp8.set_compute("w8a8")
    wide = fp8.A8_WIDE_BN, fp8.A8_WIDE_WARPS
    try:
        assert fp8._wide_tiles(x.shape[0], 4)  # 407 rows over 4 experts: the prefill tiles
        got = fp8.grouped_matmul(x, q, s, ends)
        alone = fp8.grouped_matmul(x[105:106], q[2:3], s[2:3], ends.new_ones(1))
        lin = fp8.linear(x[:50], q[3], s[3])
        fp8.A8_WIDE_BN, fp8.A8_WIDE_WARPS = fp8.A8_BN, fp8.A8_WARPS
        narrow = fp8.grouped_matmul(x, q, s, ends)
    finally:
        fp8.set_compute("w8a16")
        fp8.A8_WIDE_BN, fp8.A8_WIDE_WARPS = wide
    print(f"w8a8 wide vs narrow tiles: bitwise equal {torch.equal(got, narrow)}")
    torch.testing.assert_close(got, narrow, rtol=1.6e-2, atol=1e-2)
    xq = fp8.fake_quantize_rows(x).float()
    starts = [0, *ends.tolist()[:-1]]
    want = torch.cat(
        [xq[a:b] @ dequantize(q[i], s[i]).T for i, (a, b) in enumerate(zip(starts, ends.tolist()))]
    ).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(
        lin, (xq[:50] @ dequantize(q[3], s[3]).T).to(torch.bfloat16), rtol=1.6e-2, atol=1e-2
    )
    assert torch.equal(alone, narrow[105:106])
    big = torch.randn(4093, 1024, device="cuda").to(torch.bfloat16)  # torch's block-scaled GEMM, odd rows
    fp8.set_compute("w8a8")
    try:
        assert fp8.torch_block_pays(big, 4096) or not hasattr(torch.nn.functional, "scaled_mm")
        via_torch = fp8.linear(big, q[0], s[0])
    finally:
        fp8.set_compute("w8a16")
    ref = (fp8.fake_quantize_rows(big).float() @ dequantize(q[0], s[0]).T).to(torch.bfloat16)
    torch.testing.assert_close(via_torch, ref, rtol=1.6e-2, atol=1e-2)
    plain = fp8.grouped_matmul(x, q, s, ends)  # w8a16: other numerics, close
    rel = ((got.float() - plain.float()).norm() / plain.float().norm()).item()
    print(f"w8a8 vs w8a16 grouped products: relative difference {rel:.3e}")
    assert 0 < rel < 0.06


def test_every_fp8_module_quantises_its_activations_on_both_paths_under_w8a8() -> None:
    """``w8a8`` per module, kernels against the eager path (activations fake-quantised, then
    the dequantised weights) on the same input: a linear, the grouped output projection and
    the routed experts agree within bf16 rounding, far closer than ``w8a16`` is to either."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.kernels import fp8, set_kernels
    from engine.model.attention import GroupedLinear
    from engine.model.experts import Experts
    from engine.model.qlinear import QuantLinear
    from engine.runner import ModelRunner, RunnerConfig

    mc = ModelConfig.from_dict(preset_config("flash-shape", num_hidden_layers=2))
    cfg = RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False, device="cuda", dtype="bfloat16")
    model = ModelRunner.random(mc, cfg, seed=6, fp8=True).model
    mods = dict(model.named_modules())
    lin = next(m for m in mods.values() if isinstance(m, QuantLinear))
    grouped = next(m for m in mods.values() if isinstance(m, GroupedLinear) and m.qweight is not None)
    experts = next(m for m in mods.values() if isinstance(m, Experts))
    g = torch.Generator(device="cuda").manual_seed(23)
    k_lin = lin.qweight.shape[1]
    x_lin = torch.randn(300, k_lin, device="cuda", generator=g).to(torch.bfloat16)
    x_grp = torch.randn(300, grouped.groups, grouped.qweight.shape[1], device="cuda", generator=g).to(
        torch.bfloat16
    )
    x_exp = torch.randn(600, mc.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts.num_local, (600,), device="cuda", generator=g)
    runs = {
        "linear": lambda: lin(x_lin),
        "grouped o_a": lambda: grouped(x_grp),
        "experts": lambda: experts.run_rows(x_exp, ids),
    }
    with torch.inference_mode():
        for name, run in runs.items():
            out = {}
            for compute in ("w8a8", "w8a16"):
                fp8.set_compute(compute)
                try:
                    kern = run().float()
                    set_kernels(False)
                    try:
                        eager = run().float()
                    finally:
                        set_kernels(True)
                finally:
                    fp8.set_compute("w8a16")
                out[compute] = (kern, eager)
            (k8, e8), (k16, e16) = out["w8a8"], out["w8a16"]
            d = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
            print(
                f"{name}: kernels vs eager, w8a8 {d(k8, e8):.2e}, w8a16 {d(k16, e16):.2e}; "
                f"w8a8 vs w8a16 (eager) {d(e8, e16):.2e}"
            )
            assert d(k8, e8) < 1e-2 and d(k16, e16) < 1e-2 and d(k8, e8) < 0.3 * d(e8, e16)


def test_a_w8a8_runner_is_graph_safe() -> None:
    """``fp8_compute='w8a8'`` on CUDA: the FP8 products still leave decode steps capturable,
    and a prefill's logits are finite and move from ``w8a16``'s by the activations' rounding."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.kernels import fp8
    from engine.runner import ModelRunner, RunnerConfig

    mc = ModelConfig.from_dict(preset_config("small", num_hidden_layers=2))
    batch = ForwardBatch.from_sequences([SequenceInput(list(range(3, 300)), 0, 0, [0, 1])], device="cuda")
    logits = {}
    try:
        for compute in ("w8a16", "w8a8"):
            fp8.set_compute(compute)
            cfg = RunnerConfig(
                num_blocks=8,
                num_slots=2,
                with_mtp=False,
                device="cuda",
                dtype="bfloat16",
                fp8_compute=compute,
            )
            runner = ModelRunner.random(mc, cfg, seed=5, fp8=True)
            assert runner.graphs is not None and fp8.compute() == compute
            logits[compute] = runner.execute(batch).logits.float()
    finally:
        fp8.set_compute("w8a16")
    rel = ((logits["w8a8"] - logits["w8a16"]).norm() / logits["w8a16"].norm()).item()
    print(f"w8a8 runner: logits against w8a16's, relative difference {rel:.2e}")
    assert torch.isfinite(logits["w8a8"]).all() and 0 < rel < 0.2


def test_an_fp8_runner_is_graph_safe_and_computes_as_its_dequantising_self() -> None:
    """FP8 kept quantised on CUDA (`ModelRunner.random(fp8=True)`): decode steps stay
    capturable with the FP8 kernels, and a prefill's logits match the per-use dequantisation
    (every kernel off) within bf16 rounding."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.kernels import set_kernels
    from engine.runner import ModelRunner, RunnerConfig

    mc = ModelConfig.from_dict(preset_config("small", num_hidden_layers=2))
    cfg = RunnerConfig(num_blocks=8, num_slots=2, with_mtp=False, device="cuda", dtype="bfloat16")
    runner = ModelRunner.random(mc, cfg, seed=5, fp8=True)
    assert runner.graphs is not None  # FP8 experts read by their kernel: no host round trip
    batch = ForwardBatch.from_sequences([SequenceInput(list(range(3, 300)), 0, 0, [0, 1])], device="cuda")
    got = runner.execute(batch).logits.float()
    set_kernels(False)
    try:
        want = runner.execute(batch).logits.float()
    finally:
        set_kernels(True)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"fp8 runner: kernels vs dequantise-per-use logits, relative error {rel:.2e}")
    assert rel < 2e-2


def test_the_fused_hc_weights_match_the_eager_hyper_connection() -> None:
    """hyper.hc_weights (premix, activations, softmax and Sinkhorn in two launches) against
    HyperConnection.forward with every kernel off; a row's weights are the same alone."""
    from engine.checkpoint.presets import preset_config
    from engine.config import ModelConfig
    from engine.kernels import hyper as hk
    from engine.kernels import set_kernels
    from engine.model.hyper import HyperConnection

    mc = ModelConfig.from_dict(preset_config("flash-shape", num_hidden_layers=2))
    hc = HyperConnection(mc).cuda()
    g = torch.Generator(device="cuda").manual_seed(14)
    with torch.no_grad():
        hc.fn.normal_(std=0.02, generator=g)
        hc.base.normal_(std=0.5, generator=g)
        hc.scale.uniform_(0.5, 1.5, generator=g)
    s = _streams(300, seed=2)[0]
    with torch.inference_mode():
        post, comb, x = hc(s)
        set_kernels(False)
        try:
            want_post, want_comb, want_x = hc(s)
        finally:
            set_kernels(True)
        torch.testing.assert_close(post, want_post, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(comb, want_comb, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x, want_x, rtol=1.6e-2, atol=1e-2)
        pre1, post1, comb1 = hk.hc_weights(s[7:8], hc.fn, hc.base, hc.scale, hc.norm_eps, hc.hc_eps, hc.iters)
        assert torch.equal(post1[0], post[7]) and torch.equal(comb1[0], comb[7])


def test_the_router_kernel_routes_as_the_batch_invariant_rule() -> None:
    """engine/kernels/router.py on bf16 logits at flash widths (256 experts, top 6) against the
    eager ops with the batch-invariant mode's choice (lowest id on ties, ascending ids):
    the same ids, the same bf16 weights; a row's result is the same alone."""
    import torch.nn.functional as F

    from engine.kernels import router as rk
    from engine.model.compressor import topk_lowest_index

    g = torch.Generator(device="cuda").manual_seed(15)
    logits = (torch.randn(4096, 256, device="cuda", generator=g) * 3).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    scores = F.softplus(logits).sqrt()
    ids = topk_lowest_index(scores + bias, 6).sort(dim=-1).values
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
    got_w, got_ids = rk.route(logits, bias, 6, 2.5)
    same = (got_ids == ids).all(dim=1).float().mean().item()
    print(
        f"router: rows with the same experts {same:.5f}, bitwise weights {(got_w == w).float().mean().item():.5f}"
    )
    assert same > 0.999  # softplus's last fp32 bit may reorder a near-tie after bf16 rounding
    rows = (got_ids == ids).all(dim=1)
    torch.testing.assert_close(got_w[rows], w[rows], rtol=1.6e-2, atol=0)
    one_w, one_ids = rk.route(logits[9:10], bias, 6, 2.5)
    assert torch.equal(one_ids[0], got_ids[9]) and torch.equal(one_w[0], got_w[9])


def test_the_grouped_output_projection_reads_fp8_in_place() -> None:
    """GroupedLinear kept FP8 (`o_a` of an FP8 checkpoint) through the FP8 kernel's groups,
    against its per-use dequantisation (kernels off)."""
    from engine.checkpoint.quant import quantize_fp8
    from engine.kernels import set_kernels
    from engine.model.attention import GroupedLinear

    g = torch.Generator(device="cuda").manual_seed(16)
    lin = GroupedLinear(4096, 8 * 1024, 8).cuda()
    q, s = quantize_fp8(torch.randn(8 * 1024, 4096, device="cuda", generator=g) * 0.02)
    lin.set_quantized(q, s)
    x = torch.randn(37, 8, 4096, device="cuda", generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert lin._fp8_groups(x)
        got = lin(x)
        set_kernels(False)
        try:
            want = lin(x)
        finally:
            set_kernels(True)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
