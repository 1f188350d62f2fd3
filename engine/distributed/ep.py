"""Expert parallelism: all-to-all dispatch/combine of routed tokens across EP ranks.

Attention runs data-parallel (each rank its own batch); every MoE layer then exchanges token
rows so each physical expert sees the rows routed to it, and sends the results back:

1. each (token, choice) pair goes to rank ``physical_id // experts_per_rank``;
2. counts, rows and expert ids travel with ``all_to_all_single`` (gloo on CPU, NCCL on GPU);
3. the owner runs its local experts (unweighted) and returns rows in the order received;
4. the origin puts the rows back in token order and sums them with the routing weights in a
   fixed order (`combine`), exactly as one rank does.

The rows and their expert ids travel asynchronously while the layer's shared expert computes
(the dispatch's ``alongside``), so that exchange is hidden behind compute the layer needs
anyway; the step does the same work either way, only where it waits moves, so it costs
nothing where it hides nothing. The returned rows (step 3's results) have nothing left to
overlap with inside the layer.

Every rank must enter every MoE layer of a step (a rank with no tokens still calls in with an
empty batch), because the collectives are matched by order. DeepEP's low-latency kernels are
used instead when ``deep_ep`` is importable and tensors live on CUDA (``select_dispatch``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from engine.model.experts import Experts
from engine.model.moe import Alongside, Dispatch, combine, local_dispatch


class AllToAllDispatch:
    def __init__(self, group: object | None, ep_size: int) -> None:
        if ep_size < 2:
            raise ValueError("AllToAllDispatch needs ep_size >= 2; use local dispatch for one rank")
        self.group = group
        self.ep_size = ep_size

    def _start(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> tuple[torch.Tensor, Any]:
        """Begin one exchange: (the receive buffer, its work handle; ``wait()`` before reading
        the buffer: on NCCL that orders the current stream after the transfer, on gloo it
        blocks). The handle keeps ``send`` alive until then."""
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        work = dist.all_to_all_single(
            recv, send.contiguous(), recv_splits, send_splits, group=self.group, async_op=True
        )
        return recv, work

    def _exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv, work = self._start(send, send_splits, recv_splits)
        work.wait()
        return recv

    def __call__(
        self, x: torch.Tensor, phys: torch.Tensor, weights: torch.Tensor, experts: Experts,
        alongside: Alongside | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x [N, D], phys/weights [N, k] -> routed output [N, D], plus ``alongside()`` (computed
        while the rows are in flight) when given (`engine.model.moe.Dispatch`)."""
        n, k = phys.shape
        per_rank = experts.num_local
        flat = phys.reshape(-1)  # [N*k]
        rows = torch.arange(n, device=x.device).repeat_interleave(k)
        dest = flat // per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.ep_size).to(torch.long)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_x, rows_sent = self._start(x[rows[order]], send_splits, recv_splits)  # [M, D]
        recv_e, ids_sent = self._start(flat[order], send_splits, recv_splits)  # [M]
        beside = alongside() if alongside is not None else None
        rows_sent.wait()
        ids_sent.wait()
        y = experts.run_rows(recv_x, recv_e - experts.first) if recv_x.shape[0] else recv_x
        back = self._exchange(y, recv_splits, send_splits)  # [N*k, D] in `order`
        y_rows = torch.empty_like(back)
        y_rows[order] = back  # token-major again
        routed = combine(y_rows, weights, x.dtype)
        return routed if beside is None else routed + beside


def deep_ep_available() -> bool:
    return importlib.util.find_spec("deep_ep") is not None


def select_dispatch(group: object | None, ep_size: int, device: torch.device) -> Dispatch:
    """Local for one rank; torch.distributed all-to-all otherwise.

    DeepEP (``deep_ep.Buffer`` dispatch/combine) is the intended CUDA path when importable;
    until its adapter is validated on a GPU host the all-to-all path is used everywhere.
    """
    if ep_size == 1:
        return local_dispatch
    return AllToAllDispatch(group, ep_size)
