"""The routed experts' weights and their products: the experts of one rank (`Experts`), the
shared expert, the clamped SwiGLU, and which grouped GEMM a batch takes (`experts_gemm`).
`engine.model.moe` routes tokens to them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.quant import dequantize
from engine.kernels import batch_invariant, fp8, grouped, kernels_on, rowwise
from engine.kernels.grouped import TileMaps


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] occurrences of each id in ``ids`` (values in [0, n)). ``torch.bincount`` on CUDA
    reads the largest id back to the host first; this never leaves the device."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


#: one grouped GEMM per projection for all local experts (CPU and CUDA); else a loop over experts
GROUPED_MM = hasattr(torch, "_grouped_mm")


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; one kernel on CUDA (`rowwise.swiglu`)."""
    if (
        rowwise.usable(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
        and gate.stride(-1) == 1 and up.stride(-1) == 1
    ):  # fmt: skip
        return rowwise.swiglu(gate, up, limit)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


#: Outside the batch-invariant mode, CUDA bf16 batches pick the routed experts' GEMM by their
#: average rows per expert, from `sluice bench moe` and the engine bench on the H200 at
#: flash-shape widths (docs/benchmarks.md, "Routed experts from decode to prefill sizes"; each
#: bound the geometric midpoint of the bracketing measured cells):
#: * 0.09 to 12: the grouped Triton kernel with the mode's fixed 64-row tiles (1.2-1.3x torch at
#:   0.38-6 rows per expert, 0.28x at 0.02). The tuned tiles ran within 5 % of them there in
#:   isolation, but slower in the engine's graphed decode steps (batch 256: 10.5-11.4 against
#:   9.65 ms): the engine's measurement decides.
#: * above 12 to 136: the same kernel with `grouped.TUNED_GROUPED`'s 128-row tiles
#:   (1.14-1.28x torch at 12, 48 and 96 rows per expert in two runs, 1.22x and 0.95x at 24,
#:   0.84-0.86x at 192); a 4,096-token prefill (96 rows per expert) took 17.4-18.1 ms
#:   against torch's 19.0-20.4 in the same leases.
#: * elsewhere torch's grouped GEMM.
FIXED_ROWS_PER_EXPERT = (0.09, 12.0)
TUNED_ROWS_PER_EXPERT = (12.0, 136.0)


def torch_grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, row_end: torch.Tensor, *, maps: TileMaps | None = None
) -> torch.Tensor:
    """torch's grouped GEMM with ``grouped.grouped_matmul``'s arguments: rows sorted by
    expert, their cumulative counts, weights [E, N, K] -> [R, N] (it builds no tile map)."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=row_end)


def tuned_grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, row_end: torch.Tensor, *, maps: TileMaps | None = None
) -> torch.Tensor:
    """The grouped kernel with `grouped.TUNED_GROUPED`'s tiles, same arguments."""
    return grouped.grouped_matmul(x, w, row_end, grouped.TUNED_GROUPED, maps=maps)


class GroupedMatmul(Protocol):
    """Rows sorted by expert, their cumulative counts, weights [E, N, K] -> [R, N]; ``maps``
    shares the kernel's tile map between products over the same rows."""

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, row_end: torch.Tensor, *, maps: TileMaps | None = None
    ) -> torch.Tensor: ...


#: the grouped GEMMs the bands choose between, by name (`sluice bench moe` times each)
GROUPED_GEMMS: dict[str, GroupedMatmul] = {
    "torch": torch_grouped_matmul,
    "fixed": grouped.grouped_matmul,
    "tuned": tuned_grouped_matmul,
}
#: what `force_experts_gemm` takes: "auto" (the bands above) or one GEMM for every size
EXPERTS_GEMMS = ("auto", *GROUPED_GEMMS)
_FORCED = ["auto"]


def force_experts_gemm(kind: str) -> None:
    """Process-wide: take one grouped GEMM at every size where the bands would choose (CUDA bf16,
    kernels on, outside the batch-invariant mode), or "auto" (the bands). For measuring what the
    choice is worth (``sluice bench engine --preset P --experts-gemm KIND``)."""
    if kind not in EXPERTS_GEMMS:
        raise ValueError(f"experts GEMM must be one of {EXPERTS_GEMMS}, got {kind!r}")
    _FORCED[0] = kind


def experts_gemm(x: torch.Tensor, experts: int) -> GroupedMatmul:
    """The grouped GEMM for rows x [R, D] over ``experts`` local experts: the mode's fixed tiles
    whenever the batch-invariant mode applies; on CUDA bf16 with the kernels on, by the bands
    above (or what `force_experts_gemm` set); else torch's."""
    if batch_invariant.applies(x):
        return grouped.grouped_matmul
    if x.is_cuda and x.dtype == torch.bfloat16 and kernels_on():
        if _FORCED[0] != "auto":
            return GROUPED_GEMMS[_FORCED[0]]
        rows = x.shape[0]
        if FIXED_ROWS_PER_EXPERT[0] * experts <= rows <= FIXED_ROWS_PER_EXPERT[1] * experts:
            return grouped.grouped_matmul
        if TUNED_ROWS_PER_EXPERT[0] * experts < rows <= TUNED_ROWS_PER_EXPERT[1] * experts:
            return tuned_grouped_matmul
    return torch_grouped_matmul


class Experts(nn.Module):
    """This rank's physical experts, packed as transformers stores them (optionally kept quantised)."""

    # registered by `set_quantized` only: a projection kept quantised and its block scales
    gate_up_proj_q: torch.Tensor
    gate_up_proj_s: torch.Tensor
    down_proj_q: torch.Tensor
    down_proj_s: torch.Tensor

    def __init__(
        self, num_local: int, hidden: int, inter: int, limit: float, first_physical: int = 0
    ) -> None:
        super().__init__()
        self.limit, self.first, self.num_local = limit, first_physical, num_local
        self.gate_up_proj = nn.Parameter(torch.zeros(num_local, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_local, hidden, inter))
        self.quantized: set[str] = set()

    def set_quantized(self, which: str, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep ``which`` ("gate_up_proj" or "down_proj") as FP8/FP4 + scales; dequantised per expert use."""
        if which not in ("gate_up_proj", "down_proj") or qweight.shape[0] != self.num_local:
            raise ValueError(
                f"cannot keep {which} {tuple(qweight.shape)} quantised for {self.num_local} experts"
            )
        self.register_buffer(f"{which}_q", qweight)
        self.register_buffer(f"{which}_s", scale)
        setattr(self, which, nn.Parameter(torch.empty(0), requires_grad=False))
        self.quantized.add(which)

    def _weight(self, which: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        if which in self.quantized:
            return dequantize(getattr(self, f"{which}_q")[e], getattr(self, f"{which}_s")[e]).to(dtype)
        return getattr(self, which)[e]

    def _input(self, which: str, x: torch.Tensor) -> torch.Tensor:
        """x as the product with ``which`` takes it: quantised where that weight is FP8 under
        ``w8a8`` (`engine.kernels.fp8`), as is."""
        return fp8.eager_input(x, getattr(self, f"{which}_q")) if which in self.quantized else x

    def run_rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted expert output for rows x [N, D] routed to local expert ids [N] -> [N, D]."""
        # CUDA's grouped GEMM takes bf16 only; other CUDA dtypes take the loop, as do weights
        # kept quantised except FP8 on CUDA (`_fp8_grouped`)
        if self.quantized and not self._fp8_grouped(x):
            return self._run_rows_loop(x, local_ids)
        if not GROUPED_MM or x.shape[0] == 0 or (x.is_cuda and x.dtype != torch.bfloat16):
            return self._run_rows_loop(x, local_ids)
        order, offs = self._group(local_ids)
        y = self._grouped(x[order], offs)
        out = torch.empty_like(x)
        out[order] = y.to(out.dtype)
        return out

    def _group(self, local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' order grouped by expert (stable) and each expert group's end (int32)."""
        order = torch.argsort(local_ids, stable=True)
        return order, torch.cumsum(count_ids(local_ids, self.num_local), 0).to(torch.int32)

    def _fp8_grouped(self, x: torch.Tensor) -> bool:
        """Both projections kept as FP8 and rows x that `engine.kernels.fp8` multiplies (bf16,
        CUDA): the weights are read as FP8, never dequantised to a copy."""
        return (
            self.quantized == {"gate_up_proj", "down_proj"}
            and fp8.usable(x, self.gate_up_proj_q) and self.down_proj_q.dtype == torch.float8_e4m3fn
        )  # fmt: skip

    def _grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Expert outputs of rows x [N, D] already grouped by expert (``offs``: each group's end)."""
        maps: TileMaps = {}  # both products run over the same rows: one tile map
        if self.quantized:  # FP8 (`_fp8_grouped`)
            gate_up = fp8.grouped_matmul(x, self.gate_up_proj_q, self.gate_up_proj_s, offs, maps=maps)
            gate, up = gate_up.chunk(2, dim=-1)
            act = swiglu_clamped(gate, up, self.limit)
            return fp8.grouped_matmul(act, self.down_proj_q, self.down_proj_s, offs, maps=maps)
        gemm = experts_gemm(x, self.num_local)
        gate, up = gemm(x, self.gate_up_proj, offs, maps=maps).chunk(2, dim=-1)  # [N, 2I]
        return gemm(swiglu_clamped(gate, up, self.limit), self.down_proj, offs, maps=maps)

    def run_and_combine(
        self, x: torch.Tensor, tokens: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """`combine` of `run_rows` on rows ``x[tokens]`` in one pass, on CUDA: the grouped
        rows are gathered from x at once and summed from where the GEMM left them
        (`engine.kernels.rowwise.combine`). None where that path does not apply."""
        if not (
            rowwise.usable(x, weights, self.gate_up_proj)
            and x.dtype == torch.bfloat16
            and (self._fp8_grouped(x) if self.quantized else GROUPED_MM)
        ):
            return None
        if tokens.shape[0] == 0:
            return None
        order, offs = self._group(local_ids)
        y = self._grouped(x[tokens[order]], offs)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        return rowwise.combine(y, inverse, weights, x.dtype)

    def _run_rows_loop(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(local_ids).tolist():
            rows = (local_ids == e).nonzero().squeeze(1)
            gate, up = F.linear(
                self._input("gate_up_proj", x[rows]), self._weight("gate_up_proj", e, x.dtype)
            ).chunk(2, dim=-1)
            act = self._input("down_proj", swiglu_clamped(gate, up, self.limit))
            out[rows] = F.linear(act, self._weight("down_proj", e, x.dtype)).to(out.dtype)
        return out


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_clamped(self.gate_proj(x), self.up_proj(x), self.limit))
