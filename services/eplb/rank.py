"""Per-rank EPLB driver: the thin torch.distributed adapter around the pure controller.

Every rank of an EP group owns one :class:`EplbRankRunner` and calls
:meth:`EplbRankRunner.after_step` once per engine step, after the forward pass (and after
``recorder.end_step()``). All ranks call it at the same steps (EP ranks step together).

- When a decision is due, the window sums of all ranks are all-reduced (each rank counted
  the tokens it dispatched), and every rank runs the same deterministic controller on the
  same sum, so all reach the same decision with no coordinator process.
- The weight moves then run ``layers_per_step`` layers per engine step: for each layer the
  ranks exchange weights into fresh buffers (the old ones served the step that just ran),
  then each rank swaps in the new buffers and switches that layer's replica tables,
  before the next forward pass. Serving continues between layers.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from engine.eplb import ExpertLoadRecorder, RemapStats, ReplicaMap, remap_expert_weights
from router.eplb.placement import Placement
from services.eplb.controller import EplbConfig, EplbController, LayerRemap


class ExpertWeightStore(Protocol):
    """What an MoE model exposes to EPLB: this rank's expert weights per layer.

    ``expert_weights(layer)`` returns name -> tensor [slots_per_rank, ...] (the same names,
    shapes and dtypes on every rank); ``swap_expert_weights(layer, new)`` replaces them by
    ``new`` (same names and shapes) between forward passes; when it is called, the runner's
    ``ReplicaMap`` already holds the layer's new row. Nothing else may change.
    """

    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]: ...

    def swap_expert_weights(self, layer: int, new: dict[str, torch.Tensor]) -> None: ...


class EplbRankRunner:
    def __init__(
        self,
        config: EplbConfig,
        store: ExpertWeightStore,
        recorder: ExpertLoadRecorder,
        replica_map: ReplicaMap,
        rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.store, self.recorder, self.replica_map = store, recorder, replica_map
        self.rank, self.group = rank, group
        initial = Placement.from_phy2log(
            replica_map.phy2log.cpu().numpy(), replica_map.num_logical, replica_map.num_ranks
        )
        self.controller = EplbController(
            config, recorder.num_layers, replica_map.num_logical, replica_map.num_ranks, initial=initial
        )
        self._batches: list[tuple[LayerRemap, ...]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.layers_moved = 0

    @property
    def remapping(self) -> bool:
        return bool(self._batches)

    def after_step(self, step: int) -> None:
        """Advance EPLB by one engine step (collective over the group when it acts)."""
        if self._batches:
            for lr in self._batches.pop(0):
                self._move(lr)
        elif self.controller.due(step):
            window = self.recorder.window_sum().clone()  # [L, E] this rank's tokens
            dist.all_reduce(window, group=self.group)
            decision = self.controller.decide(step, [window.cpu().numpy()])
            self._batches = decision.batches()

    def _move(self, lr: LayerRemap) -> None:
        new, stats = remap_expert_weights(lr.plan, self.store.expert_weights(lr.layer), self.rank, self.group)
        # tables first, so a store may derive its own routing state from the updated map;
        # both change before the next forward pass
        self.replica_map.update_layer(lr.layer, lr.new_phy2log)
        self.store.swap_expert_weights(lr.layer, new)
        self.controller.commit_layer(lr.layer)
        self._account(stats)

    def _account(self, stats: RemapStats) -> None:
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.layers_moved += 1
