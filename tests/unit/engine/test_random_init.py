"""`ModelRunner.random`: an EP rank (or an EPLB replica) holds exactly the tensors that one rank
holding every expert holds; the values are seeded, finite and not all equal."""

from __future__ import annotations

import torch

from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from engine.model.moe import ExpertPlacement
from engine.runner import ModelRunner, RunnerConfig

CFG = ModelConfig.from_dict(preset_config("tiny", num_hidden_layers=2))


def _runner(ep: int, rank: int, placement: ExpertPlacement | None = None, seed: int = 0) -> ModelRunner:
    cfg = RunnerConfig(num_blocks=1, num_slots=1, with_mtp=False, ep_size=ep, ep_rank=rank)
    return ModelRunner.random(CFG, cfg, placements=[placement], seed=seed)


def test_ep_ranks_hold_the_single_rank_experts_and_shared_weights() -> None:
    one = dict(_runner(1, 0).model.named_parameters())
    n = CFG.n_routed_experts // 2
    for rank in range(2):
        for name, p in _runner(2, rank).model.named_parameters():
            want = one[name][rank * n : (rank + 1) * n] if ".experts." in name else one[name]
            assert torch.equal(p, want), (rank, name)


def test_replicas_equal_their_logical_expert_and_seed_matters() -> None:
    e = CFG.n_routed_experts
    phy2log = torch.tensor([*range(e), 0, 3, 3, e - 1])  # 4 redundant slots over 2 ranks
    one = _runner(1, 0).model.model.layers[1].mlp.experts.gate_up_proj
    for rank in range(2):
        pl = ExpertPlacement(phy2log, e, ep_size=2, offset=rank)
        got = _runner(2, rank, pl).model.model.layers[1].mlp.experts.gate_up_proj
        for slot, logical in enumerate(pl.local_logical(rank)):
            assert torch.equal(got[slot], one[logical])
    other = _runner(1, 0, seed=1).model.model.layers[1].mlp.experts.gate_up_proj
    assert not torch.equal(one, other)
    assert torch.isfinite(one).all() and one.std() > 0
    tid2eid = _runner(1, 0).model.model.layers[0].mlp.gate.tid2eid
    assert tid2eid.min() >= 0 and tid2eid.max() < e
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
