"""EPLB wired into the engine's `ModelRunner` (one object per EP rank).

- :func:`initial_placement`: the physical expert slots a runner is built with
  (``ModelRunner(..., placement=...)``), ``E + ep_size * r`` slots, the controller's
  start-up placement (every layer the same).
- :class:`MoEExpertStore`: the engine's MoE layers as EPLB's ``ExpertWeightStore``
  (``MoE.expert_weights`` / ``MoE.load_expert_weights``), keeping each layer's
  ``ExpertPlacement`` equal to its row of the ``ReplicaMap``.
- :class:`EngineEplb`: records ``MoE.last_load`` of every layer after each engine step and
  drives :class:`services.eplb.rank.EplbRankRunner` (window all-reduce, decision, layer by
  layer weight moves over the EP process group).

Usage, on every EP rank, at the same steps::

    placement = initial_placement(cfg, n_routed_experts, ep_size, ep_rank)
    runner = ModelRunner(path, RunnerConfig(ep_size=..., ep_rank=...), placement=placement)
    eplb = EngineEplb(cfg, runner.model.moe_layers(), ep_rank)
    for step in ...:
        runner.execute(batch)
        eplb.after_step(step)

Limits: weights kept quantised (``RunnerConfig(keep_quantized=True)``) cannot be remapped
yet (``MoE.expert_weights`` raises); the swap rebinds parameters, so CUDA graphs would
need an in-place copy instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from engine.eplb import ExpertLoadRecorder, ReplicaMap
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.moe import ExpertPlacement, MoE
from engine.runner import ModelRunner
from services.eplb.controller import EplbConfig, EplbController
from services.eplb.rank import EplbRankRunner


def initial_placement(config: EplbConfig, num_experts: int, ep_size: int, ep_rank: int) -> ExpertPlacement:
    """The start-up placement of one MoE layer for ``ModelRunner(..., placement=...)``."""
    row = EplbController(config, 1, num_experts, ep_size).placement.phy2log[0]
    return ExpertPlacement(torch.as_tensor(row, dtype=torch.int64), num_experts, ep_size, offset=ep_rank)


class MoEExpertStore:
    """``ExpertWeightStore`` over a model's MoE layers (layer ``l`` = ``moes[l]``).

    ``swap_expert_weights`` installs the moved weights, then the layer's placement from
    ``replica_map`` (which the rank runner has already switched), so weights and routing
    change together between two forward passes.
    """

    def __init__(self, moes: Sequence[MoE], replica_map: ReplicaMap, offset: int) -> None:
        self.moes, self.replica_map, self.offset = list(moes), replica_map, offset

    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return self.moes[layer].expert_weights()

    def swap_expert_weights(self, layer: int, new: dict[str, torch.Tensor]) -> None:
        self.moes[layer].load_expert_weights(new)
        self.sync_placement(layer)

    def sync_placement(self, layer: int) -> None:
        """Route ``layer`` by the replica map's current row."""
        placement = ExpertPlacement.from_replica_map(self.replica_map, layer, self.offset)
        self.moes[layer].set_placement(placement)


class EngineEplb:
    """EPLB for one EP rank of an engine: call :meth:`after_step` after every forward step.

    ``moes``: the rank's MoE layers (``ModelRunner.model.moe_layers()``), all built with
    the same EP size and physical slot count; ``rank``: this rank's index in ``group`` (the
    EP process group; ``None`` = the default group). ``keep_history`` keeps every step's
    loads for :meth:`ExpertLoadRecorder.dump` (this rank's tokens only).
    """

    def __init__(
        self,
        config: EplbConfig,
        moes: Sequence[MoE],
        rank: int,
        group: dist.ProcessGroup | None = None,
        keep_history: bool = False,
        store_type: type[MoEExpertStore] = MoEExpertStore,
    ) -> None:
        if not moes:
            raise ValueError("EngineEplb needs at least one MoE layer")
        self.moes = list(moes)
        first = self.moes[0].placement
        if any(m.placement.num_physical != first.num_physical for m in self.moes):
            raise ValueError("every MoE layer must have the same number of physical experts")
        phy2log = torch.stack([m.placement.phy2log.long().cpu() for m in self.moes])  # [L, P]
        device = self.moes[0].last_load.device  # routing tables live where the MoE runs
        self.replica_map = ReplicaMap(phy2log, first.num_logical, first.ep_size, device=device)
        self.recorder = ExpertLoadRecorder(
            len(self.moes),
            first.num_logical,
            config.window_steps,
            device=device,
            keep_history=keep_history,
        )
        self.store = store_type(self.moes, self.replica_map, first.offset)
        self.runner = EplbRankRunner(config, self.store, self.recorder, self.replica_map, rank, group)

    def after_step(self, step: int) -> None:
        """Record the step's loads, then let EPLB decide or move (collective when it acts)."""
        for layer, moe in enumerate(self.moes):
            self.recorder.record_counts(layer, moe.last_load)
        self.recorder.end_step()
        self.runner.after_step(step)


def blocks_needed(num_tokens: int, block: int = 256) -> int:
    """Compressed-state blocks one sequence of ``num_tokens`` positions needs (256 positions each)."""
    return -(-num_tokens // block)


def greedy_generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Greedy decoding of ``prompts`` together, one engine step per token: step 0 prefills
    every prompt, each later step feeds one token per sequence. Sequence ``i`` uses SWA slot
    ``i`` and blocks ``[i * n, (i + 1) * n)``; the runner must have that many.
    ``on_step(step, logits [B, vocab])`` runs after every step (e.g. to call
    :meth:`EngineEplb.after_step`). Returns the new tokens of every sequence."""
    if new_tokens < 1 or not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs non-empty prompts and new_tokens >= 1")
    n = max(blocks_needed(len(p) + new_tokens) for p in prompts)
    tables = [list(range(i * n, (i + 1) * n)) for i in range(len(prompts))]
    seqs = [SequenceInput(list(p), 0, i, tables[i]) for i, p in enumerate(prompts)]
    done = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(new_tokens):
        logits = runner.execute(ForwardBatch.from_sequences(seqs)).logits  # [B, vocab]
        if on_step is not None:
            on_step(step, logits)
        nxt = logits.argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            out[i].append(tok)
        seqs = [SequenceInput([nxt[i]], done[i], i, tables[i]) for i in range(len(prompts))]
        done = [d + 1 for d in done]
    return out
