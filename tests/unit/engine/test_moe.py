"""MoE pieces: the grouped-GEMM expert path equals the per-expert loop; routing rules."""

from __future__ import annotations

import pytest
import torch

from engine.model.experts import Experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_expert_loop(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    experts = Experts(6, 32, 16, limit=0.5).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g))
    x = torch.randn(50, 32, generator=g).to(dtype)
    ids = torch.randint(0, 5, (50,), generator=g)  # expert 5 gets no rows
    with torch.no_grad():
        fast, loop = experts.run_rows(x, ids), experts._run_rows_loop(x, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fast.float() - loop.float()).abs().max().item() <= tol * loop.float().abs().max().item()


def test_combine_of_an_empty_batch_is_empty() -> None:
    """An idle EP rank still enters every MoE layer: combining zero tokens gives zero rows."""
    from engine.model.moe import combine

    out = combine(torch.zeros(0, 16), torch.zeros(0, 2), torch.bfloat16)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_the_experts_gemm_can_be_forced_for_a_measurement_and_only_to_known_kinds() -> None:
    """`force_experts_gemm` (``sluice bench engine --experts-gemm``): a kind it does not know is
    refused; on the CPU every kind leaves torch's grouped GEMM (the Triton kernels are CUDA's)."""
    from engine.model.experts import EXPERTS_GEMMS, experts_gemm, force_experts_gemm, torch_grouped_matmul

    with pytest.raises(ValueError, match="one of"):
        force_experts_gemm("cutlass")
    x = torch.zeros(96 * 8, 16, dtype=torch.bfloat16)
    try:
        for kind in EXPERTS_GEMMS:
            force_experts_gemm(kind)
            assert experts_gemm(x, 8) is torch_grouped_matmul
    finally:
        force_experts_gemm("auto")
