"""Engine-side EPLB pieces (torch, no Ray): load recording, replica choice, weight moves.

- :class:`ExpertLoadRecorder`: per-layer tokens-per-logical-expert counters over a sliding
  window of steps, updated on device without host syncs.
- :class:`ReplicaMap`: logical -> physical tables as tensors, and the per-token replica
  choice. The split rule is the one defined in ``router.eplb.split`` (round-robin of an
  expert's tokens over its replicas in arrival order, starting at ``offset``); it is
  re-implemented here on tensors because the engine does not import the router, and a
  test checks the two agree token for token.
- :func:`remap_expert_weights`: execute one layer's move plan (``router.eplb.transfer``)
  among the ranks of an EP group with point-to-point sends, into fresh buffers, so the old
  weights keep serving until the caller swaps them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist


class ExpertLoadRecorder:
    """Tokens routed to each logical expert, per layer, over the last ``window`` steps.

    ``record(layer, topk_ids)`` adds one batch (any number of calls per step and layer);
    ``end_step()`` closes the step. Only closed steps are exported. Buffers live on
    ``device``; ``record`` never synchronises with the host. With ``keep_history`` every
    closed step is also copied to host memory (for dumping a load file; this syncs).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window: int,
        device: torch.device | str = "cpu",
        keep_history: bool = False,
    ) -> None:
        if num_layers < 1 or num_experts < 1 or window < 1:
            raise ValueError("num_layers, num_experts and window must be >= 1")
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        self._buf = torch.zeros(
            window + 1, num_layers, num_experts, dtype=torch.int64, device=device
        )  # [W+1, L, E]
        self._pos = 0  # row of the open step; the other W rows are the closed window
        self.steps_closed = 0
        self._history: list[np.ndarray] | None = [] if keep_history else None

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count ``topk_ids`` [tokens, top_k] (logical expert ids) for ``layer``."""
        ids = topk_ids.reshape(-1).to(torch.int64)
        self._buf[self._pos, layer].index_add_(0, ids, torch.ones_like(ids))

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add per-expert token counts [E] (e.g. an MoE layer's own load counter)."""
        self._buf[self._pos, layer].add_(counts.to(self._buf.dtype))

    def end_step(self) -> None:
        if self._history is not None:
            self._history.append(self._buf[self._pos].cpu().numpy().copy())
        self.steps_closed += 1
        self._pos = (self._pos + 1) % (self.window + 1)
        self._buf[self._pos].zero_()

    def _closed_rows(self) -> list[int]:
        n = min(self.steps_closed, self.window)
        return [(self._pos - n + i) % (self.window + 1) for i in range(n)]  # oldest first

    def window_counts(self) -> np.ndarray:
        """[n, L, E] int64 counts of the last ``n <= window`` closed steps, oldest first."""
        rows = self._closed_rows()
        if not rows:
            return np.zeros((0, self.num_layers, self.num_experts), dtype=np.int64)
        return self._buf[rows].cpu().numpy()

    def window_sum(self) -> torch.Tensor:
        """[L, E] on device: the window's total (what a placement is computed from)."""
        rows = self._closed_rows()
        if not rows:
            return torch.zeros_like(self._buf[0])
        return self._buf[rows].sum(0)

    def history(self) -> np.ndarray:
        """[steps, L, E] every closed step since construction (needs ``keep_history``)."""
        if self._history is None:
            raise ValueError("history() needs ExpertLoadRecorder(keep_history=True)")
        if not self._history:
            return np.zeros((0, self.num_layers, self.num_experts), dtype=np.int64)
        return np.stack(self._history)

    def dump(self, path: str) -> None:
        """Write the history as the ``.npz`` that ``sluice bench eplb --loads`` reads."""
        np.savez_compressed(path, counts=self.history())


def _tables(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [P] -> (log2phy [E, max_rep] padded -1, logcnt [E]); replicas in slot order."""
    n_phys = phy2log.numel()
    logcnt = torch.bincount(phy2log, minlength=num_logical)
    if logcnt.numel() != num_logical or bool((logcnt == 0).any()):
        raise ValueError(f"phy2log must hold every logical expert in [0, {num_logical}) at least once")
    order = torch.argsort(phy2log, stable=True)
    starts = torch.cumsum(logcnt, 0) - logcnt
    replica = torch.empty_like(phy2log)
    replica[order] = torch.arange(n_phys, device=phy2log.device) - starts[phy2log[order]]
    log2phy = torch.full((num_logical, int(logcnt.max())), -1, dtype=torch.int64, device=phy2log.device)
    log2phy[phy2log, replica] = torch.arange(n_phys, device=phy2log.device)
    return log2phy, logcnt


class ReplicaMap:
    """Logical -> physical expert tables for every layer, and the replica choice.

    ``phy2log`` [L, P] (rank-major slots, ``P / num_ranks`` per rank). ``map`` is pure
    tensor code (no host sync) and deterministic: token ``t``'s j-th pick of expert ``e``
    in arrival order goes to replica ``(occurrence + offset) % count[e]``; the engine
    passes its DP rank as ``offset`` so remainders spread over replicas.
    """

    def __init__(
        self,
        phy2log: np.ndarray | torch.Tensor,
        num_logical: int,
        num_ranks: int,
        device: torch.device | str = "cpu",
    ) -> None:
        p2l = torch.as_tensor(np.asarray(phy2log), dtype=torch.int64, device=device)
        if p2l.ndim != 2 or p2l.shape[1] % num_ranks:
            raise ValueError(f"phy2log must be [layers, n_phys] with n_phys divisible by {num_ranks}")
        self.num_logical, self.num_ranks = num_logical, num_ranks
        self.slots_per_rank = p2l.shape[1] // num_ranks
        self.phy2log = p2l
        self._log2phy: list[torch.Tensor] = []
        self._logcnt: list[torch.Tensor] = []
        for layer in range(p2l.shape[0]):
            log2phy, logcnt = _tables(p2l[layer], num_logical)
            self._log2phy.append(log2phy)
            self._logcnt.append(logcnt)

    def update_layer(self, layer: int, phy2log: np.ndarray | torch.Tensor) -> None:
        """Switch one layer to a new placement (call after its weights are in place)."""
        row = torch.as_tensor(np.asarray(phy2log), dtype=torch.int64, device=self.phy2log.device)
        if row.shape != self.phy2log[layer].shape:
            raise ValueError(f"phy2log row must have shape {tuple(self.phy2log[layer].shape)}")
        self._log2phy[layer], self._logcnt[layer] = _tables(row, self.num_logical)
        self.phy2log[layer] = row

    def logcnt(self, layer: int) -> torch.Tensor:
        return self._logcnt[layer]

    def local_experts(self, layer: int, rank: int) -> torch.Tensor:
        """[slots_per_rank] logical expert held by each of ``rank``'s slots."""
        s = self.slots_per_rank
        return self.phy2log[layer, rank * s : (rank + 1) * s]

    def log2phy(self, layer: int) -> torch.Tensor:
        """[E, max_replicas] physical slots per logical expert (-1 padded)."""
        return self._log2phy[layer]

    def map(self, layer: int, topk_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Logical ``topk_ids`` [T, k] -> physical slot ids [T, k]."""
        return choose_replicas(self._log2phy[layer], self._logcnt[layer], topk_ids, offset)


def choose_replicas(
    log2phy: torch.Tensor, logcnt: torch.Tensor, topk_ids: torch.Tensor, offset: int = 0
) -> torch.Tensor:
    """The split rule on tensors: logical ids [T, k] -> physical ids [T, k].

    ``log2phy`` [E, R] (-1 padded), ``logcnt`` [E]. The j-th occurrence of expert ``e`` in
    ``topk_ids`` (row-major: token, then top-k position) goes to replica
    ``(j + offset) % logcnt[e]``. No host sync; deterministic (stable sort).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k], token-major arrival order
    counts = torch.zeros(logcnt.numel(), dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    occ = torch.empty_like(flat)
    occ[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    replica = (occ + offset) % logcnt[flat]
    return log2phy[flat, replica].reshape(topk_ids.shape)


class RemapPlanLike(Protocol):
    """What :func:`remap_expert_weights` needs of a plan (``router.eplb.transfer.RemapPlan``
    made by the controller; the engine does not import the router). ``transfers`` items
    have ``src_rank, src_local, dst_rank, dst_local``; ``local`` = (rank, old_local,
    new_local) copies from the rank's own old buffer; ``dup`` = (rank, new_local_src,
    new_local_dst) copies of a slot received in this remap."""

    @property
    def transfers(self) -> Sequence[Any]: ...

    @property
    def local(self) -> Sequence[tuple[int, int, int]]: ...

    @property
    def dup(self) -> Sequence[tuple[int, int, int]]: ...


@dataclass(frozen=True)
class RemapStats:
    bytes_sent: int
    bytes_received: int
    bytes_copied_locally: int


def remap_expert_weights(
    plan: RemapPlanLike,
    weights: dict[str, torch.Tensor],
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, torch.Tensor], RemapStats]:
    """Execute ``plan`` for this ``rank`` (its index in ``group``).

    ``weights`` maps a name to this rank's old tensor [slots_per_rank, ...] (every rank
    passes the same names, shapes and dtypes). Returns new tensors of the same shapes,
    freshly allocated: the old ones are only read, so they can keep serving until the
    caller swaps in the new ones. Collective over ``group``: every rank must call it with
    the same plan. Works on gloo (CPU tensors) and NCCL (CUDA tensors).
    """
    names = sorted(weights)
    new = {k: torch.empty_like(weights[k]) for k in names}
    row_bytes = sum(weights[k][0].numel() * weights[k].element_size() for k in names)

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    ops: list[dist.P2POp] = []
    for t in plan.transfers:  # the same order on every rank keeps each pair's FIFO aligned
        if t.dst_rank == rank and t.src_rank != rank:
            ops += [dist.P2POp(dist.irecv, new[k][t.dst_local], peer(t.src_rank), group) for k in names]
        elif t.src_rank == rank and t.dst_rank != rank:
            ops += [dist.P2POp(dist.isend, weights[k][t.src_local], peer(t.dst_rank), group) for k in names]
    n_sent = sum(1 for t in plan.transfers if t.src_rank == rank)
    n_recv = sum(1 for t in plan.transfers if t.dst_rank == rank)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    n_local = 0
    for r, src, dst in plan.local:
        if r == rank:
            for k in names:
                new[k][dst].copy_(weights[k][src])
            n_local += 1
    for r, src, dst in plan.dup:
        if r == rank:
            for k in names:
                new[k][dst].copy_(new[k][src])
            n_local += 1
    return new, RemapStats(n_sent * row_bytes, n_recv * row_bytes, n_local * row_bytes)
