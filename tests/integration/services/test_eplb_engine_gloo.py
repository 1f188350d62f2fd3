"""EPLB inside the real engine: two gloo ranks, each a `ModelRunner` with expert parallelism
and redundant expert slots, decode greedily while EPLB re-places experts and moves their
weights between the ranks. Every token must equal one rank's generation without EPLB; the
negative control switches the routing tables without moving the weights and must diverge.
The recorded loads then go through the EPLB bench's ``--loads`` pipeline."""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.distributed.rendezvous import join_group
from engine.runner import ModelRunner, RunnerConfig
from services.eplb.controller import EplbConfig
from services.eplb.engine import EngineEplb, MoEExpertStore, greedy_generate, initial_placement
from tests.ranks import run_ranks

pytestmark = pytest.mark.integration

WORLD, EXPERTS, NEW_TOKENS = 2, 8, 32
MODES = ("eplb", "no_weight_move")
# decisions at steps 4, 12, 20, 28; one layer moves per step after each
CFG = dict(num_redundant_per_rank=1, window_steps=4, period_steps=8, layers_per_step=1)
SNAPSHOTS = (3, 11, 19, 27)  # steps just before each decision: placement of the previous period


def _prompt(rank: int) -> list[int]:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(3, 1000, (20 + 5 * rank,), generator=g).tolist()


class NoWeightMoveStore(MoEExpertStore):
    """Negative control: installs the new routing tables but keeps the old weights."""

    def swap_expert_weights(self, layer: int, new: dict[str, torch.Tensor]) -> None:
        self.sync_placement(layer)


def _generate(path: str, rank: int, mode: str, out_dir: Path) -> dict:
    cfg = EplbConfig.for_pool("decode", **CFG)
    placement = initial_placement(cfg, EXPERTS, WORLD, rank)
    rcfg = RunnerConfig(num_blocks=1, num_slots=1, ep_size=WORLD, ep_rank=rank, with_mtp=False)
    runner = ModelRunner(path, rcfg, placement=placement)
    store = MoEExpertStore if mode == "eplb" else NoWeightMoveStore
    eplb = EngineEplb(cfg, runner.model.moe_layers(), rank, keep_history=True, store_type=store)
    tables: list[list] = []
    logits: list[torch.Tensor] = []

    def on_step(step: int, step_logits: torch.Tensor) -> None:
        logits.append(step_logits[0].clone())
        eplb.after_step(step)
        tables.append(eplb.replica_map.phy2log.tolist())

    tokens = greedy_generate(runner, [_prompt(rank)], NEW_TOKENS, on_step)[0]
    eplb.recorder.dump(str(out_dir / f"{mode}-loads{rank}.npz"))
    torch.save(torch.stack(logits), out_dir / f"{mode}-logits{rank}.pt")
    r = eplb.runner
    return {"tokens": tokens, "tables": tables, "sent": r.bytes_sent, "received": r.bytes_received}


def _worker(rank: int, rendezvous: str, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    join_group("gloo", rendezvous, rank, WORLD)
    try:
        torch.set_num_threads(1)
        out = {mode: _generate(path, rank, mode, Path(out_dir)) for mode in MODES}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_run(checkpoint_factory, tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """Both modes on 2 gloo ranks (one spawn); -> (checkpoint, output dir, per-rank results)."""
    path = checkpoint_factory("tiny", seed=3)
    out_dir = tmp_path_factory.mktemp("eplb-engine")
    run_ranks(_worker, WORLD, str(path), str(out_dir), timeout_s=180)
    return path, out_dir, [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@functools.cache
def _single_rank(path: Path, rank: int) -> tuple[list[int], torch.Tensor]:
    """The same generation on one rank, no EP, no redundant slots, no EPLB."""
    runner = ModelRunner(path, RunnerConfig(num_blocks=1, num_slots=1, with_mtp=False))
    logits: list[torch.Tensor] = []
    tokens = greedy_generate(runner, [_prompt(rank)], NEW_TOKENS, lambda s, lg: logits.append(lg[0].clone()))
    return tokens[0], torch.stack(logits)


def test_ep2_engine_remaps_during_greedy_generation_and_tokens_are_unchanged(ep_run) -> None:
    path, out_dir, ranks = ep_run
    runs = [r["eplb"] for r in ranks]
    assert runs[0]["tables"] == runs[1]["tables"], "ranks disagree on the placement"
    tables = np.array(runs[0]["tables"])  # [steps, L, P]
    periods = [tables[s] for s in SNAPSHOTS] + [tables[-1]]
    changed = [not np.array_equal(a, b) for a, b in zip(periods, periods[1:])]
    assert sum(changed) >= 2, f"expected >= 2 re-placements that change phy2log, got {changed}"
    assert runs[0]["sent"] > 0 and runs[1]["sent"] > 0
    assert runs[0]["sent"] == runs[1]["received"] and runs[1]["sent"] == runs[0]["received"]
    for rank in range(WORLD):
        want_tokens, want_logits = _single_rank(path, rank)
        got_logits = torch.load(out_dir / f"eplb-logits{rank}.pt")
        assert runs[rank]["tokens"] == want_tokens, f"rank {rank}: tokens changed under EPLB"
        assert (got_logits - want_logits).abs().max().item() < 1e-4, f"rank {rank}: logits drifted"


def test_negative_control_switching_tables_without_moving_weights_changes_outputs(ep_run) -> None:
    path, out_dir, ranks = ep_run
    diverged, tokens_changed = [], []
    for rank in range(WORLD):
        want_tokens, want_logits = _single_rank(path, rank)
        tokens_changed.append(ranks[rank]["no_weight_move"]["tokens"] != want_tokens)
        got = torch.load(out_dir / f"no_weight_move-logits{rank}.pt")
        diff = (got - want_logits).abs().amax(-1)  # [steps]
        first_move = SNAPSHOTS[0] + 2  # the first layer switches after step 4, used from step 5
        assert diff[:first_move].max().item() < 1e-4, "outputs differ before any table switch"
        diverged.append(diff[first_move:].max().item())
    assert max(diverged) > 1e-2, f"wrong expert weights went unnoticed: max logit diff {diverged}"
    assert any(tokens_changed), "the greedy tokens survived wrong expert weights"


def test_recorded_engine_loads_flow_into_the_eplb_bench(ep_run) -> None:
    from services.bench import eplb as bench

    _, out_dir, ranks = ep_run
    per_rank = [np.load(out_dir / f"eplb-loads{r}.npz")["counts"] for r in range(WORLD)]
    top_k = 2
    for rank, counts in enumerate(per_rank):  # [steps, L, E]: every token counted once per pick
        assert counts.shape == (NEW_TOKENS, 4, EXPERTS)
        want = [len(_prompt(rank)) * top_k] + [top_k] * (NEW_TOKENS - 1)
        assert (counts.sum(-1) == np.array(want)[:, None]).all()
    loads = out_dir / "loads-ep2.npz"
    np.savez_compressed(loads, counts=sum(per_rank))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--loads", str(loads), "--pool", "decode", "--ep", "2", "--window", "4", "--period", "8"]
    )
    report = bench.run(args)
    res = report.results["recorded decode EP2"]
    assert report.config["loads"]["shape"] == [NEW_TOKENS, 4, EXPERTS]
    assert res["eval_steps_per_run"] > 0 and res["placements_per_run"] >= 2
    assert all(v >= 1.0 for v in res["imbalance_mean_over_seeds"].values())


def _hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decode, recomputing the whole sequence each token (no cache)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._experts_implementation = "eager"
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.slow  # ~15 s: transformers recomputes the whole sequence per token
def test_ep2_eplb_tokens_equal_the_transformers_greedy(ep_run) -> None:
    path, _, ranks = ep_run
    for rank in range(WORLD):
        assert ranks[rank]["eplb"]["tokens"] == _hf_greedy(path, _prompt(rank), NEW_TOKENS)
