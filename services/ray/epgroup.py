"""``EPGroup``: one engine instance as an expert-parallel group of Ray actors, one per rank.

The ranks live in one Ray placement group (one bundle per rank, ``STRICT_PACK``: one node).
The driver makes a rendezvous file (`engine.distributed.rendezvous.rendezvous_file`) and
hands its path to every rank; each rank joins ``torch.distributed`` through it (gloo on CPU,
NCCL on CUDA) and builds a ``ModelRunner`` with its ``ep_size``/``ep_rank``
on the same checkpoint. Attention is data-parallel: ``execute`` takes one batch per rank and
runs all ranks at once; the MoE layers exchange token rows with all-to-all
(`engine.distributed.ep`).

Every rank must enter every MoE layer of a step, since the collectives are matched by order.
A rank with nothing to run (``None`` or an empty list) enters them idle: it calls each
main-model MoE layer's dispatch with zero rows, so it still serves the rows that the other
ranks route to its experts (``ForwardBatch`` itself refuses an empty batch).

Timeouts: the group's default collective timeout is ``timeout_s`` (5 s), so no rank waits
on a dead peer longer than that; the rendezvous (the file store) has ``init_timeout_s``,
and the ranks call ``init_process_group`` together only once every actor is up, so a slow
actor start does not eat into the 5 s. Inputs and outputs are plain data: ``SequenceInput``
lists in, numpy arrays out.

This runs forwards only: the caller builds each rank's batch. Serving engines of several
EP ranks are engine actors stepping in lockstep (``engine.distributed.lockstep``,
``services.ray.pools``). A failure surfaces as an exception from ``execute`` (``shutdown``
and start anew); the NCCL path has not run (no GPU on the development host).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_BUNDLE: Mapping[str, float] = {"CPU": 1}


class EPRank:
    """One EP rank (a plain class; ``EPGroup`` wraps it with ``ray.remote``). ``runner_config``:
    ``RunnerConfig`` fields as a dict, without ``ep_size``/``ep_rank``."""

    def __init__(
        self,
        checkpoint: str,
        rank: int,
        world_size: int,
        store_path: str,
        runner_config: Mapping[str, Any] | None = None,
        timeout_s: float = 5.0,
        init_timeout_s: float = 60.0,
        num_threads: int = 1,
    ) -> None:
        self.checkpoint, self.rank, self.world_size = str(checkpoint), rank, world_size
        self.store_path = store_path
        self.runner_config = dict(runner_config or {})
        self.timeout_s, self.init_timeout_s = timeout_s, init_timeout_s
        self.num_threads = num_threads
        self.runner: Any = None

    def ready(self) -> int:
        return os.getpid()

    def join(self) -> dict[str, Any]:
        """Join the group through the rendezvous file, then load this rank's runner."""
        import torch
        import torch.distributed as dist

        from engine.distributed.lockstep import EPMember
        from engine.runner import ModelRunner, RunnerConfig

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        device = str(self.runner_config.get("device", "cpu"))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device if ":" in device else "cuda:0"))
        else:
            from services import envs

            envs.export_to_children({"GLOO_SOCKET_IFNAME": "lo"})  # the ranks share a host: pairs on loopback
        member = EPMember(self.rank, self.world_size, self.store_path, self.timeout_s, self.init_timeout_s)
        member.join(device)
        cfg = RunnerConfig(**{**self.runner_config, "ep_size": self.world_size, "ep_rank": self.rank})
        self.runner = ModelRunner(self.checkpoint, cfg, ep_group=dist.group.WORLD)
        return {"rank": self.rank, "pid": os.getpid(), "backend": dist.get_backend()}

    def execute(self, seqs: Sequence[Any] | None) -> np.ndarray:
        """Run this rank's part of one step: ``seqs`` (``SequenceInput``s) or nothing (idle).
        Returns the logits [num_sampled, vocab] as fp32 numpy ([0, vocab] when idle)."""
        import torch

        from engine.forward_batch import ForwardBatch

        runner = self.runner
        if runner is None:
            raise RuntimeError("this rank has not joined its group")
        if not seqs:
            self._idle()
            return np.zeros((0, runner.model_cfg.vocab_size), dtype=np.float32)
        batch = ForwardBatch.from_sequences(list(seqs), device=runner.cfg.device)
        out = runner.execute(batch)
        return out.logits.detach().to(device="cpu", dtype=torch.float32).numpy()

    def _idle(self) -> None:
        """Enter every main-model MoE layer with zero rows, serving the rows the other ranks
        send to this rank's experts (``engine.distributed.lockstep.idle_pass``)."""
        from engine.distributed.lockstep import idle_pass

        idle_pass(self.runner)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.runner = None


class EPGroup:
    """``ep_size`` ``EPRank`` actors of one engine instance in one placement group.

    ``bundle``: the resources of one rank (default one CPU; e.g. ``{"CPU": 1, "GPU": 1}``
    with ``device="cuda"`` in ``runner_config``). ``execute(batches)`` takes one entry per
    rank and returns each rank's logits; ``shutdown()`` destroys the process group and
    removes the actors and the placement group."""

    def __init__(
        self,
        checkpoint: str,
        ep_size: int,
        runner_config: Mapping[str, Any] | None = None,
        *,
        bundle: Mapping[str, float] | None = None,
        timeout_s: float = 5.0,
        init_timeout_s: float = 60.0,
        call_timeout_s: float = 120.0,
        name: str | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.distributed.rendezvous import rendezvous_file

        if ep_size < 2:
            raise ValueError("an EP group needs ep_size >= 2; use a ModelRunner for one rank")
        cfg = dict(runner_config or {})
        if "ep_size" in cfg or "ep_rank" in cfg:
            raise ValueError("ep_size/ep_rank are the group's, not runner_config's")
        self.ep_size, self.call_timeout_s = ep_size, call_timeout_s
        per_rank = dict(bundle or DEFAULT_BUNDLE)
        self.store: Any = rendezvous_file()  # the ranks' meeting file, held until shutdown
        self.pg = placement_group(
            [dict(per_rank) for _ in range(ep_size)], strategy="STRICT_PACK", name=name or ""
        )
        self.actors: list[Any] = []
        try:
            try:
                ray.get(self.pg.ready(), timeout=call_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"no room for {ep_size} bundles of {per_rank} on one node within {call_timeout_s} s"
                ) from None
            gpus = float(per_rank.get("GPU", 0))
            custom = {k: v for k, v in per_rank.items() if k not in ("CPU", "GPU", "memory")}
            cls = ray.remote(EPRank)
            for rank in range(ep_size):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                self.actors.append(
                    cls.options(
                        num_cpus=float(per_rank.get("CPU", 0)),
                        num_gpus=gpus,
                        resources=custom,
                        scheduling_strategy=strategy,
                    ).remote(str(checkpoint), rank, ep_size, self.store.path, cfg, timeout_s, init_timeout_s)
                )
            ray.get([a.ready.remote() for a in self.actors], timeout=call_timeout_s)  # every process is up
            self.info = ray.get([a.join.remote() for a in self.actors], timeout=call_timeout_s)
        except BaseException:
            for a in self.actors:
                ray.kill(a)
            remove_placement_group(self.pg)
            raise

    def execute(self, batches: Sequence[Sequence[Any] | None]) -> list[np.ndarray]:
        """One step on every rank at once: ``batches[r]`` is rank r's list of ``SequenceInput``
        (``None`` / ``[]``: the rank has no tokens and only serves its experts). Returns the
        logits of each rank, [num_sampled, vocab] fp32 numpy."""
        import ray

        if len(batches) != self.ep_size:
            raise ValueError(f"give one batch per rank ({self.ep_size}), not {len(batches)}")
        refs = [a.execute.remote(list(b) if b else None) for a, b in zip(self.actors, batches)]
        return list(ray.get(refs, timeout=self.call_timeout_s))

    def shutdown(self) -> None:
        """Destroy the process group, kill the actors, remove the placement group, drop the store."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.pg is None:
            return  # already shut down
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=self.call_timeout_s)
        except Exception:  # noqa: BLE001 - a dead rank must not stop the cleanup
            pass
        finally:
            for a in self.actors:
                ray.kill(a)
            self.actors = []
            remove_placement_group(self.pg)
            if self.store is not None:
                self.store.close()
            self.pg, self.store = None, None
