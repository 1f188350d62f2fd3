"""`services.eplb.engine` on one process: the store keeps weights and routing together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from services.eplb.controller import EplbConfig
from services.eplb.engine import EngineEplb, MoEExpertStore, blocks_needed, greedy_generate, initial_placement

CFG = EplbConfig.for_pool("decode", num_redundant_per_rank=2, window_steps=2, period_steps=4)
PROMPT = list(range(10, 40))


def _runner(path) -> ModelRunner:
    placement = initial_placement(CFG, 8, 1, 0)
    return ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1, with_mtp=False), placement=placement)


def _logits(runner: ModelRunner) -> torch.Tensor:
    return runner.execute(ForwardBatch.from_sequences([SequenceInput(PROMPT, 0, 0, [0])])).logits[0]


def test_initial_placement_has_every_expert_and_the_redundant_slots() -> None:
    p = initial_placement(CFG, 8, 2, 1)
    assert p.num_physical == 8 + 2 * 2 and p.ep_size == 2 and p.offset == 1
    assert sorted(set(p.phy2log.tolist())) == list(range(8))
    assert p.local_logical(0)[:4] == [0, 1, 2, 3]  # each rank keeps its own experts first


@pytest.mark.parametrize("move_weights", [True, False])
def test_store_swaps_weights_and_routing_together(checkpoint_factory, move_weights: bool) -> None:
    runner = _runner(checkpoint_factory("tiny", seed=3))
    want = _logits(runner)
    eplb = EngineEplb(CFG, runner.model.moe_layers(), rank=0)
    assert isinstance(eplb.store, MoEExpertStore)
    old = eplb.replica_map.phy2log[1].clone()  # [10]
    perm = torch.roll(torch.arange(old.numel()), 3)  # new slot j takes old slot perm[j]
    eplb.replica_map.update_layer(1, old[perm])
    weights = eplb.store.expert_weights(1)
    new = {k: v[perm].clone() for k, v in weights.items()} if move_weights else weights
    eplb.store.swap_expert_weights(1, new)
    assert runner.model.moe_layers()[1].placement.phy2log.tolist() == old[perm].tolist()
    diff = (_logits(runner) - want).abs().max().item()
    if move_weights:
        assert diff < 1e-5
    else:
        assert diff > 1e-3  # routing switched, weights stayed: the output must change


def test_engine_eplb_records_every_moe_layer_per_step(checkpoint_factory) -> None:
    runner = _runner(checkpoint_factory("tiny", seed=3))
    eplb = EngineEplb(CFG, runner.model.moe_layers(), rank=0, keep_history=True)
    # one step only: no decision is due before window_steps closed steps, so no collective
    out = greedy_generate(runner, [PROMPT], 1, lambda step, _: eplb.after_step(step))
    assert len(out[0]) == 1
    hist = eplb.recorder.history()  # [1, L, E]
    assert hist.shape == (1, 4, 8) and (hist.sum(-1) == len(PROMPT) * 2).all()
    assert torch.equal(torch.as_tensor(hist[0]), runner.expert_load())


def test_validation() -> None:
    with pytest.raises(ValueError, match="at least one MoE"):
        EngineEplb(CFG, [], rank=0)
    assert blocks_needed(256) == 1 and blocks_needed(257) == 2
    with pytest.raises(ValueError, match="new_tokens"):
        greedy_generate(None, [[1]], 0)  # type: ignore[arg-type]


def test_record_expert_loads_command_writes_a_bench_load_file(checkpoint_factory, tmp_path, capsys) -> None:
    from router.eplb.simulate import RecordedLoads
    from services.cli import main

    out = tmp_path / "loads.npz"
    model = checkpoint_factory("tiny", seed=3)
    argv = ["record-expert-loads", "--model", str(model), "--out", str(out), "--seqs", "3", "--tokens", "4"]
    assert main(argv) == 0
    loads = RecordedLoads.load(str(out))
    assert (loads.num_steps, loads.num_layers, loads.num_experts) == (4, 4, 8)
    counts = loads.counts(np.arange(4))
    assert (counts[0].sum(-1) == 3 * 32 * 2).all() and (counts[1:].sum(-1) == 3 * 2).all()
    assert '"shape": [4, 4, 8]' in capsys.readouterr().out


def test_record_expert_loads_routes_held_out_text_through_the_trained_preset(tmp_path, capsys) -> None:
    """The trained preset's own tokenizer: prompts are held-out corpus windows, not random ids."""
    from engine.checkpoint.presets import SHIPPED
    from router.eplb.simulate import RecordedLoads
    from services.cli import main

    out = tmp_path / "loads.npz"
    argv = ["record-expert-loads", "--model", str(SHIPPED["trained"]), "--out", str(out), "--seqs", "2", "--tokens", "3",
            "--prompts", "heldout"]  # fmt: skip
    assert main(argv) == 0
    assert '"prompts": "heldout-v1 windows"' in capsys.readouterr().out
    loads = RecordedLoads.load(str(out))
    assert (loads.num_steps, loads.num_experts) == (3, 8)  # routed-MoE layers of 8 experts
