"""Mixture of experts: sqrtsoftplus router (+ correction bias) or hash routing, SwiGLU-clamped experts,
shared expert; logical -> physical expert lookup through a replaceable placement; per-step load counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.quant import dequantize
from engine.config import ModelConfig


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each logical expert lives. ``log2phy [E, R]`` lists up to R physical replicas (-1 pad),
    ``logcnt [E]`` how many are valid; physical expert p is held by rank ``p // experts_per_rank``."""

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_physical: int
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.num_physical % self.ep_size:
            raise ValueError(
                f"{self.num_physical} physical experts do not split over {self.ep_size} EP ranks"
            )
        if int(self.logcnt.min()) < 1:
            raise ValueError("every logical expert needs at least one physical replica")

    @property
    def experts_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    @classmethod
    def identity(cls, num_experts: int, ep_size: int = 1) -> ExpertPlacement:
        return cls(
            torch.arange(num_experts).view(-1, 1),
            torch.ones(num_experts, dtype=torch.long),
            num_experts,
            ep_size,
        )

    def physical(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical ids [N, k] -> physical ids [N, k]; replicas chosen round-robin by row (deterministic)."""
        log2phy, logcnt = self.log2phy.to(logical.device), self.logcnt.to(logical.device)
        rows = torch.arange(logical.shape[0], device=logical.device).view(-1, 1)
        replica = (rows + torch.arange(logical.shape[1], device=logical.device).view(1, -1)) % logcnt[logical]
        return log2phy[logical, replica]


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    tid2eid: torch.Tensor
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scale, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k], logical expert ids [T, k])."""
        scores = F.softplus(F.linear(x, self.weight)).sqrt()  # [T, E]
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class Experts(nn.Module):
    """This rank's physical experts, packed as transformers stores them (optionally kept quantised)."""

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

    def run_rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted expert output for rows x [N, D] routed to local expert ids [N] -> [N, D]."""
        out = torch.zeros_like(x)
        for e in torch.unique(local_ids).tolist():
            rows = (local_ids == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows], self._weight("gate_up_proj", e, x.dtype)).chunk(2, dim=-1)
            down = self._weight("down_proj", e, x.dtype)
            out[rows] = F.linear(swiglu_clamped(gate, up, self.limit), down).to(out.dtype)
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


#: (x [N, D], physical ids [N, k], weights [N, k], local experts) -> routed output [N, D]
Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Experts], torch.Tensor]


def local_dispatch(
    x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """Single-rank MoE: every physical expert is local."""
    n, k = phys.shape
    rows = torch.arange(n, device=x.device).repeat_interleave(k)
    y = experts.run_rows(x[rows], phys.reshape(-1) - experts.first)  # [N*k, D]
    y = y * weights.reshape(-1, 1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


class MoE(nn.Module):
    last_load: torch.Tensor
    dispatch: Dispatch

    def __init__(
        self, cfg: ModelConfig, hashed: bool, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> None:
        super().__init__()
        self.placement = placement or ExpertPlacement.identity(cfg.n_routed_experts)
        per_rank = self.placement.experts_per_rank
        self.gate = Router(cfg, hashed)
        self.experts = Experts(
            per_rank,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.swiglu_limit,
            first_physical=ep_rank * per_rank,
        )
        self.shared_experts = SharedExpert(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit
        )
        self.dispatch: Dispatch = local_dispatch
        # tokens routed to each logical expert in the last forward (for EPLB)
        self.register_buffer(
            "last_load", torch.zeros(cfg.n_routed_experts, dtype=torch.long), persistent=False
        )

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Swap the logical->physical map (the caller moves the expert weights to match)."""
        if placement.experts_per_rank != self.experts.num_local:
            raise ValueError("a new placement must keep the number of physical experts per rank")
        self.placement = placement

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        weights, ids = self.gate(x, input_ids)
        self.last_load.zero_().index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        routed = self.dispatch(x, self.placement.physical(ids), weights, self.experts)
        return routed + self.shared_experts(x)
