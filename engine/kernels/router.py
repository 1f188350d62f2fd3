"""The MoE router's work after its logits, per token in one launch.

Eagerly `engine.model.moe.Router` runs softplus, sqrt, the correction bias, a top-k, a
gather, a sum and three scalings over [T, E]: about ten launches a layer, each a few
microseconds of a decode step inside a CUDA graph and a host launch in prefill. The kernel
does the same operations in the same dtypes, one program per token:

* scores = sqrt(softplus(logits)), each rounded to the logits' dtype as the eager ops round;
* the k largest of scores + bias, equal values resolving to the lowest expert id (the
  batch-invariant mode's rule, `topk_lowest_index`), returned in ascending id order;
* weights = scores[ids] / (sum + 1e-20) * scale, with the sum in fp32 rounded to the dtype
  and each step rounded as the eager bf16 ops round.

Per token, so batch-invariant.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels import kernels_on, tracks_grad


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(
        logit_ptr, bias_ptr, w_ptr, id_ptr, E, s_l, scale, K: tl.constexpr, BE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BE)
        m = e < E
        raw = tl.load(logit_ptr + t * s_l + e, mask=m, other=0.0)
        dtype = raw.dtype
        x = raw.to(tl.float32)
        z = tl.exp(-tl.abs(x))  # softplus = max(x, 0) + log1p(exp(-|x|)); torch: x past 20
        lp = tl.where(z < 1e-4, z - 0.5 * z * z, tl.log(1.0 + z))
        sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + lp).to(dtype).to(tl.float32)
        sc = tl.sqrt(sp).to(dtype).to(tl.float32)
        left = tl.where(m, sc + tl.load(bias_ptr + e, mask=m, other=0.0), float("-inf"))
        chosen = tl.zeros((BE,), tl.int32)
        for _ in tl.static_range(K):  # the largest left, lowest id on ties
            best = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == best, e, BE), axis=0)
            chosen = tl.where(e == pick, 1, chosen)
            left = tl.where(e == pick, float("-inf"), left)
        total = tl.sum(tl.where(chosen == 1, sc, 0.0), axis=0).to(dtype).to(tl.float32)
        denom = (total + 1e-20).to(dtype).to(tl.float32)
        w = ((sc / denom).to(dtype).to(tl.float32) * scale).to(dtype)
        slot = tl.cumsum(chosen, axis=0) - 1  # ascending ids
        sel = chosen == 1
        tl.store(id_ptr + t * K + slot, e.to(tl.int64), mask=sel)
        tl.store(w_ptr + t * K + slot, w, mask=sel)

    return {"route": route_kernel}


def usable(logits: torch.Tensor, k: int) -> bool:
    """CUDA bf16/fp16 logits [T, E] (E <= 4096) with Triton, outside autograd. fp32 keeps the
    eager ops: there the kernel's softplus differs from torch's in the last bits, where a
    16-bit dtype's rounding hides it."""
    return (
        logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16) and logits.dim() == 2
        and 0 < k <= logits.shape[1] <= 4096 and kernels_on() and not tracks_grad(logits)
    )  # fmt: skip


def route(
    logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], correction bias [E] (fp32) -> (weights [T, k] in the logits' dtype,
    expert ids [T, k] ascending)."""
    t, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.long, device=logits.device)
    if t:
        _kernels()["route"][(t,)](
            logits, bias.float().contiguous(), w, ids, e, logits.stride(0), float(scale),
            K=k, BE=max(16, 1 << (e - 1).bit_length()), num_warps=4,
        )  # fmt: skip
    return w, ids
