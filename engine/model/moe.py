"""Mixture of experts: sqrtsoftplus router (+ correction bias) or hash routing to the experts of
`engine.model.experts`; logical -> physical expert lookup through a replaceable placement; the
dispatch (one rank here, `engine.distributed.ep` across ranks); per-step load counters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kernels import batch_invariant, rowwise
from engine.kernels import router as router_kernel
from engine.model.compressor import topk_lowest_index
from engine.model.experts import Experts, SharedExpert, count_ids


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each logical expert lives: ``phy2log [P]`` names the logical expert of each physical
    slot (rank-major: rank r holds slots ``[r*P/ep, (r+1)*P/ep)``); a logical expert may have
    several replicas. ``offset`` (the DP rank) spreads remainders over replicas.

    Replica choice (the EPLB contract): the j-th occurrence of expert e in a step's top-k ids
    (token-major) goes to replica ``(j + offset) % count[e]``; deterministic, no host sync.
    """

    phy2log: torch.Tensor  # [P] int64
    num_logical: int
    ep_size: int = 1
    offset: int = 0

    def __post_init__(self) -> None:
        p = self.phy2log.numel()
        if p % self.ep_size:
            raise ValueError(f"{p} physical experts do not split over {self.ep_size} EP ranks")
        counts = torch.bincount(self.phy2log.long(), minlength=self.num_logical)
        if counts.numel() != self.num_logical or bool((counts == 0).any()):
            raise ValueError(
                f"phy2log must hold every logical expert in [0, {self.num_logical}) at least once"
            )

    @property
    def num_physical(self) -> int:
        return self.phy2log.numel()

    @property
    def experts_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def local_logical(self, rank: int) -> list[int]:
        """Logical expert held by each of ``rank``'s physical slots."""
        n = self.experts_per_rank
        return self.phy2log[rank * n : (rank + 1) * n].tolist()

    @functools.cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log2phy [E, R] physical slots per logical expert, -1 padded; logcnt [E])."""
        p2l = self.phy2log.long()
        logcnt = torch.bincount(p2l, minlength=self.num_logical)
        order = torch.argsort(p2l, stable=True)
        starts = torch.cumsum(logcnt, 0) - logcnt
        replica = torch.empty_like(p2l)
        replica[order] = torch.arange(p2l.numel()) - starts[p2l[order]]
        log2phy = torch.full((self.num_logical, int(logcnt.max())), -1, dtype=torch.long)
        log2phy[p2l, replica] = torch.arange(p2l.numel())
        return log2phy, logcnt

    @classmethod
    def from_replica_map(cls, rmap: Any, layer: int, offset: int = 0) -> ExpertPlacement:
        """One layer of an `engine.eplb.ReplicaMap` (``phy2log [L, P]``, ``num_logical``, ``num_ranks``)."""
        return cls(
            rmap.phy2log[layer].detach().cpu().clone(), int(rmap.num_logical), int(rmap.num_ranks), offset
        )

    @classmethod
    def identity(cls, num_experts: int, ep_size: int = 1) -> ExpertPlacement:
        return cls(torch.arange(num_experts), num_experts, ep_size)

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``tables`` on ``device``, copied there once (a copy per MoE layer per step would
        wait for the device, and a CUDA graph cannot capture it)."""
        cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault(
            "_device_tables", {}
        )
        if device not in cache:
            cache[device] = tuple(t.to(device) for t in self.tables)  # type: ignore[assignment]
        return cache[device]

    def physical(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical ids [N, k] -> physical slot ids [N, k]."""
        log2phy, logcnt = self.device_tables(logical.device)
        if int(log2phy.shape[1]) == 1:
            return log2phy[logical, 0]
        flat = logical.reshape(-1)
        counts = count_ids(flat, self.num_logical)
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(flat, stable=True)
        occ = torch.empty_like(flat)
        occ[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return log2phy[flat, (occ + self.offset) % logcnt[flat]].reshape(logical.shape)


#: bumped whenever an MoE layer's placement or expert tensors are replaced: a CUDA graph
#: captured before reads the old tensors and must be dropped (`engine.cuda_graphs`)
_WEIGHT_EPOCH = [0]


def weight_epoch() -> int:
    return _WEIGHT_EPOCH[0]


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
        logits = F.linear(x, self.weight)
        if not self.hashed and router_kernel.usable(logits, self.top_k):  # the rest in one launch
            return router_kernel.route(logits, self.e_score_correction_bias, self.top_k, self.scale)
        scores = F.softplus(logits).sqrt()  # [T, E]
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            if batch_invariant.enabled():
                # bf16 scores tie often, and top-k's pick among equals (and its order) may
                # follow the batch's shape: ties go to the lowest id, then ids ascend (the
                # experts' outputs are summed in this order)
                ids = topk_lowest_index(biased, self.top_k).sort(dim=-1).values
            else:
                ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


#: The rest of an MoE layer's output (its shared expert) as a dispatch takes it: computed while
#: the routed rows are in flight (`engine.distributed.ep`), or after them on one rank
Alongside = Callable[[], torch.Tensor]


class Dispatch(Protocol):
    def __call__(
        self, x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor, experts: Experts,
        alongside: Alongside | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x [N, D], physical ids and weights [N, k] -> the routed output [N, D], plus
        ``alongside()`` when given."""
        ...


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: y [N*k, D] token-major, weights [N, k] -> [N, D].

    A fixed-order fp32 sum (no atomics), so one rank and EP ranks combine bit for bit alike and
    repeated runs agree. On CUDA every caller takes the one kernel (`engine.kernels.rowwise`),
    as the single-rank path's `Experts.run_and_combine` does: its order is the kernel's."""
    n, k = weights.shape
    if rowwise.usable(y, weights) and n:
        return rowwise.combine(y, torch.arange(n * k, device=y.device), weights, dtype)
    # the explicit width keeps an empty batch (an idle EP rank, n == 0) well defined
    return (y.view(n, k, y.shape[-1]).float() * weights.float().unsqueeze(-1)).sum(1).to(dtype)


def local_dispatch(
    x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor, experts: Experts,
    alongside: Alongside | None = None,
) -> torch.Tensor:  # fmt: skip
    """Single-rank MoE: every physical expert is local (`Dispatch`)."""
    n, k = phys.shape
    rows = torch.arange(n, device=x.device).repeat_interleave(k)
    local = phys.reshape(-1) - experts.first
    routed = experts.run_and_combine(x, rows, local, weights)
    if routed is None:
        routed = combine(experts.run_rows(x[rows], local), weights, x.dtype)  # [N*k, D] rows
    return routed if alongside is None else routed + alongside()


class MoE(nn.Module):
    last_load: torch.Tensor
    dispatch: Dispatch

    def __init__(
        self, cfg: ModelConfig, hashed: bool, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> None:
        super().__init__()
        self.placement = placement or ExpertPlacement.identity(cfg.n_routed_experts)
        self.ep_rank = ep_rank
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
        """Swap the logical->physical map; call after the expert weights match it
        (`expert_weights` / `load_expert_weights`, e.g. around EPLB's ``remap_expert_weights``)."""
        if placement.experts_per_rank != self.experts.num_local:
            raise ValueError("a new placement must keep the number of physical experts per rank")
        self.placement = placement
        _WEIGHT_EPOCH[0] += 1

    def expert_weights(self) -> dict[str, torch.Tensor]:
        """This rank's physical expert tensors [slots, ...] by name (dense layout only)."""
        if self.experts.quantized:
            raise ValueError("expert weights kept quantised cannot be remapped yet; load dequantised")
        return {"gate_up_proj": self.experts.gate_up_proj.data, "down_proj": self.experts.down_proj.data}

    def load_expert_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace this rank's expert tensors (same shapes) with ``weights``."""
        for name, t in weights.items():
            dst = getattr(self.experts, name)
            if t.shape != dst.shape:
                raise ValueError(f"{name}: new shape {tuple(t.shape)} != {tuple(dst.shape)}")
            dst.data = t.to(device=dst.device, dtype=dst.dtype)
        _WEIGHT_EPOCH[0] += 1

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, real: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]. ``real`` [T] (1 or 0): which rows the load counters count
        (a padded CUDA-graph batch's padding rows are not load)."""
        weights, ids = self.gate(x, input_ids)
        flat = ids.reshape(-1)
        counted = torch.ones_like(flat) if real is None else real.repeat_interleave(ids.shape[1])
        self.last_load.zero_().index_add_(0, flat, counted)
        return self.dispatch(
            x, self.placement.physical(ids), weights, self.experts, alongside=lambda: self.shared_experts(x)
        )
