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

With speculative decoding, a step also runs the MTP layer once per drafting pass, and its
MoE exchanges rows too; how many passes depends on the rank's own drafting depth and
requests. ``DraftLockstep`` matches them: before its forward a rank states the most passes
its step can run, the group takes the largest, and after drafting each rank makes up the
difference with empty passes through the MTP layer's MoE (an idle rank states 0 and makes
up all of them).

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
    for moe in runner.model.moe_layers():  # the MTP layers' too: no token of this rank was routed
        moe.last_load.zero_()  # EPLB records zero load
    rows = _no_rows(runner)
    with torch.inference_mode():
        for layer in runner.model.model.layers:
            _all_to_all(layer.mlp.dispatch)(*rows, layer.mlp.experts)


def _no_rows(runner: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MoE exchange's inputs with zero rows: (x, physical experts, weights)."""
    mc, dev, dtype = runner.model_cfg, torch.device(runner.cfg.device), runner.cfg.torch_dtype
    k = int(mc.num_experts_per_tok)
    return (
        torch.zeros((0, mc.hidden_size), dtype=dtype, device=dev),
        torch.zeros((0, k), dtype=torch.long, device=dev),
        torch.zeros((0, k), dtype=torch.float32, device=dev),
    )


def _all_to_all(dispatch: Any) -> Any:
    """``dispatch``, checked to be the group's all-to-all: an exchange with zero rows of this
    rank's only makes sense there."""
    from engine.distributed.ep import AllToAllDispatch

    if not isinstance(dispatch, AllToAllDispatch):
        raise RuntimeError(
            f"an empty MoE exchange needs the all-to-all dispatch, not {type(dispatch).__name__}"
        )
    return dispatch


class DraftLockstep:
    """An EP rank's MTP-layer passes matched with its group's (the module doc).

    Installed on the drafter's MTP MoE, it counts the passes the rank's own step runs.
    `agree` (before the step's forward, every rank, an idle one with 0) takes the group's
    largest bound; a pass beyond it raises before it exchanges anything (a bound that was
    too low is a bug, and a rank waiting on a collective nobody else calls would only
    time out); `pad` (after the step's drafting) runs the passes the rank did not, with
    zero rows of its own."""

    def __init__(self, runner: Any, moe: Any, group: Any) -> None:
        """``moe``: the drafting MTP layer's MoE, whose dispatch is the group's all-to-all.
        Keeps no reference to ``moe`` or ``runner`` (``moe`` holds this object's counting
        dispatch): no cycle keeps the process group alive past the engine."""
        self.group = group
        self._dispatch = _all_to_all(moe.dispatch)
        self._experts = moe.experts
        self._rows = _no_rows(runner)
        moe.dispatch = self._counted
        self._bound = torch.zeros(1, dtype=torch.int32, device=torch.device(runner.cfg.device))
        self.agreed = 0  # this step's passes: the most any rank of the group may run
        self.ran = 0  # of them, this rank's own so far
        self.padded = 0  # empty passes run to match the group, in all

    def _counted(self, *args: Any, **kwargs: Any) -> Any:
        if self.ran >= self.agreed:
            raise RuntimeError(
                f"an MTP pass beyond the {self.agreed} the EP group agreed for this step: "
                "its bound (Speculation.pass_bound) is too low"
            )
        self.ran += 1
        return self._dispatch(*args, **kwargs)

    def agree(self, bound: int) -> int:
        """The group's most MTP passes this step (one collective, every rank calls it)."""
        self._bound[0] = bound
        dist.all_reduce(self._bound, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed, self.ran = int(self._bound.item()), 0
        return self.agreed

    def pad(self) -> None:
        """Run the agreed passes this rank's step did not, with zero rows of its own."""
        missing = self.agreed - self.ran
        with torch.inference_mode():
            for _ in range(missing):
                self._dispatch(*self._rows, self._experts)
        self.padded += missing
        self.agreed = self.ran = 0


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
            drafts = self.core.executor.speculation.lockstep
            if drafts is not None:  # the busy ranks agree on their MTP passes before their forward
                drafts.agree(0)
            idle_pass(runner)
            if drafts is not None:
                drafts.pad()
            self.idle_passes += 1
        elif ran > 1:
            raise RuntimeError(f"an engine step ran {ran} forwards; EP lockstep needs one per step")
        self.forwards += 1
        if self.eplb is not None:  # the same step on every rank: its collectives line up
            self.eplb.after_step(self.forwards)
        return outputs
