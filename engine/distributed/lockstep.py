"""Expert-parallel ranks that step together: one engine per rank, one model instance.

Attention is data-parallel: each rank is a whole engine (its own scheduler, caches and
requests), and the ranks share the routed experts through the all-to-all exchange of every
MoE layer (``engine.distributed.ep``). Those collectives are matched by order, so every rank
must run the same number of forward passes. ``Lockstep`` keeps them in step:

1. each loop iteration, every rank says whether it has a forward to run and whether it is
   stopping (one small ``all_reduce`` of [ready, stop] with MAX);
2. if any rank is ready, every rank runs exactly one forward: its own step, or, with
   nothing to run, an idle pass through every MoE layer with zero rows (it still serves the
   rows the other ranks send to its experts);
3. if none is, each does only bookkeeping (store fetches, idle saves) and waits briefly;
4. when any rank stops, all stop together.

With EPLB (``services.eplb.engine.EngineEplb``) each rank records its experts' loads after
every forward (zero for an idle pass) and the group re-places experts on the pool's window
and period, moving weights layer by layer between forwards.

The ranks' collectives time out after the group's timeout (5 s by default), so no rank
waits on a dead peer longer than that: the engine then fails and the group is restarted
as a whole. The engine must run its steps synchronously (``async_scheduling=False``):
every collective is issued from the engine's own thread, in order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EPMember:
    """One rank's place in an EP group: ``rank`` of ``size``, meeting the others through a
    store its launcher provides (``join(store=...)``; the Ray pools pass one kept by an actor
    of the cluster, so ranks on several hosts meet) or through a file
    (``torch.distributed.FileStore`` at ``store_path``, a path no other group uses, when the
    ranks share a host). Either way nothing new listens: a ``TCPStore`` server binds every
    interface."""

    rank: int
    size: int
    store_path: str = ""
    timeout_s: float = 5.0  # every collective: the dead-peer detection bound
    init_timeout_s: float = 120.0  # the rendezvous: every rank of the group must arrive

    def __post_init__(self) -> None:
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"EP member needs size >= 2 and 0 <= rank < size, got rank {self.rank} of {self.size}"
            )

    def join(self, device: str, store: Any = None) -> Any:
        """``init_process_group`` for this rank (gloo on CPU, NCCL on CUDA); the default group.
        ``store``: the rendezvous ``torch.distributed.Store`` (default: the file)."""
        cuda = device.startswith("cuda")
        if store is None:
            if not self.store_path:
                raise ValueError("an EP member needs a rendezvous: a store_path, or a store to join")
            store = dist.FileStore(self.store_path, self.size)
        store.set_timeout(datetime.timedelta(seconds=self.init_timeout_s))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        return dist.group.WORLD


def idle_pass(runner: Any) -> None:
    """Enter every main-model MoE layer with zero rows, in layer order, as a forward does:
    the same all-to-alls, serving the rows the other ranks route to this rank's experts."""
    import torch

    from engine.distributed.ep import AllToAllDispatch

    mc, dev, dtype = runner.model_cfg, torch.device(runner.cfg.device), runner.cfg.torch_dtype
    with torch.inference_mode():
        for layer in runner.model.model.layers:
            moe = layer.mlp
            d, experts = moe.dispatch, moe.experts
            if not isinstance(d, AllToAllDispatch):
                raise RuntimeError(f"an idle rank needs the all-to-all dispatch, not {type(d).__name__}")
            moe.last_load.zero_()  # no token of this rank was routed: EPLB records zero load
            k = int(mc.num_experts_per_tok)
            x = torch.zeros((0, mc.hidden_size), dtype=dtype, device=dev)
            phys = torch.zeros((0, k), dtype=torch.long, device=dev)
            weights = torch.zeros((0, k), dtype=torch.float32, device=dev)
            d(x, phys, weights, experts)


class Lockstep:
    """Drives one rank's ``EngineCore`` in step with the other ranks of its group."""

    def __init__(self, core: Any, group: Any, eplb: Any = None) -> None:
        """``eplb``: an ``EngineEplb`` (``services.eplb.engine``) for this rank, called after
        every forward; every rank of the group has one or none does."""
        self.core, self.group, self.eplb = core, group, eplb
        device = torch.device(core.config.device)
        self._flags = torch.zeros(2, dtype=torch.int32, device=device)
        self.forwards = 0  # this rank's forward passes, its own and idle
        self.idle_passes = 0

    def agree(self, ready: bool, stop: bool) -> tuple[bool, bool]:
        """(some rank is ready, some rank is stopping): one collective, every rank calls it."""
        self._flags[0], self._flags[1] = int(ready), int(stop)
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flags[0].item()), bool(self._flags[1].item())

    def step(self) -> list[Any]:
        """One forward on this rank (its own step if it has one, else an idle pass); the
        engine's outputs. Only after ``agree`` said some rank is ready."""
        runner = self.core.runner
        before = runner.forwards
        outputs = self.core.step() if self.core.will_forward() else self.core.housekeeping()
        ran = runner.forwards - before
        if ran == 0:
            idle_pass(runner)
            self.idle_passes += 1
        elif ran > 1:
            raise RuntimeError(f"an engine step ran {ran} forwards; EP lockstep needs one per step")
        self.forwards += 1
        if self.eplb is not None:  # the same step on every rank: its collectives line up
            self.eplb.after_step(self.forwards)
        return outputs
