"""Logical -> physical expert placement (the EPLB seam): replicas and remaps keep the logits."""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.moe import ExpertPlacement
from engine.runner import ModelRunner, RunnerConfig

NAME = "mixed_hc2"  # 8 routed experts, top-2, hash and top-k layers


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.execute(ForwardBatch.from_sequences([SequenceInput(ids, 0, 0, [0])])).logits[0]


def test_replicas_route_across_copies_and_keep_logits(reference) -> None:
    path, _ = reference(NAME)
    ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    base = _logits(ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1)), ids)
    placement = ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 5, 7]), num_logical=8)
    runner = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1), placement=placement)
    assert (_logits(runner, ids) - base).abs().max().item() < 1e-5
    moe = runner.model.moe_layers()[2]
    phys = placement.physical(torch.tensor([[0, 3]] * 4))
    assert set(phys[:, 0].tolist()) == {0, 8} and set(phys[:, 1].tolist()) == {3, 9}  # both copies used
    assert torch.equal(moe.experts.gate_up_proj[8], moe.experts.gate_up_proj[0])
    assert int(moe.last_load.sum()) == 64 * 2  # load counters stay per logical expert


def test_remap_swaps_weights_and_placement_without_changing_logits(reference) -> None:
    path, _ = reference(NAME)
    runner = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    base = _logits(runner, ids)
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])  # physical slot i now holds logical perm[i]
    for moe in runner.model.moe_layers():
        moe.load_expert_weights({k: v[perm].clone() for k, v in moe.expert_weights().items()})
        moe.set_placement(ExpertPlacement(perm, num_logical=8))
    assert (_logits(runner, ids) - base).abs().max().item() < 1e-5


def test_placement_validation() -> None:
    with pytest.raises(ValueError, match="every logical expert"):
        ExpertPlacement(torch.tensor([0, 1, 1, 2]), num_logical=4)
    with pytest.raises(ValueError, match="EP ranks"):
        ExpertPlacement(torch.arange(6), num_logical=6, ep_size=4)


def test_replica_choice_is_eplbs_and_loads_feed_its_recorder(reference) -> None:
    from engine.eplb import ExpertLoadRecorder, ReplicaMap, choose_replicas

    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 5, 7], [7, 6, 5, 4, 3, 2, 1, 0, 1, 1, 2, 2]])
    rmap = ReplicaMap(phy2log, num_logical=8, num_ranks=2)
    ids = torch.randint(0, 8, (50, 2), generator=torch.Generator().manual_seed(5))
    for layer in range(2):
        for offset in (0, 1):
            mine = ExpertPlacement.from_replica_map(rmap, layer, offset).physical(ids)
            assert torch.equal(mine, choose_replicas(rmap.log2phy(layer), rmap.logcnt(layer), ids, offset))
    path, _ = reference(NAME)
    runner = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1))
    moes = runner.model.moe_layers()
    recorder = ExpertLoadRecorder(num_layers=len(moes), num_experts=8, window=2)
    _logits(runner, list(range(30)))
    for layer, moe in enumerate(moes):
        recorder.record_counts(layer, moe.last_load)
    recorder.end_step()
    assert recorder.window_sum()[: len(runner.model.model.layers)].sum(1).tolist() == [30 * 2] * 4
