"""EP=2 and EP=4 over gloo in separate processes give the same logits as one rank; the routed
rows travel while the shared expert computes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine.distributed.ep import AllToAllDispatch
from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.experts import Experts
from engine.model.moe import ExpertPlacement, local_dispatch
from engine.runner import ModelRunner, RunnerConfig
from tests.ranks import run_ranks

NAME = "mixed_hc2"


def _prompt(rank: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 256, (30 + 9 * rank,), generator=g).tolist()


def _steps(runner: ModelRunner, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill in two chunks, then two decode tokens; each rank its own sequence (DP attention)."""
    ids = _prompt(rank)
    cut = [0, 17, len(ids) - 2, len(ids) - 1, len(ids)]
    out = []
    for a, b in zip(cut, cut[1:]):
        batch = ForwardBatch.from_sequences([SequenceInput(ids[a:b], a, 0, [0])])
        out.append(runner.execute(batch).logits[0])
    return out, runner.expert_load()


REPLICATED = [0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 5, 7]  # 12 physical slots, 6 per rank at EP=2


def _placement(world: int, replicated: bool, rank: int) -> ExpertPlacement | None:
    if not replicated:
        return None
    return ExpertPlacement(torch.tensor(REPLICATED), num_logical=8, ep_size=world, offset=rank)


def _worker(
    rank: int, rendezvous: str, world: int, path: str, out_dir: str, replicated: bool = False
) -> None:
    import torch.distributed as dist

    join_group("gloo", rendezvous, rank, world)
    try:
        torch.set_num_threads(1)
        cfg = RunnerConfig(num_blocks=2, num_slots=1, ep_size=world, ep_rank=rank)
        runner = ModelRunner(path, cfg, placement=_placement(world, replicated, rank))
        logits, load = _steps(runner, rank)
        tensors = {f"step{i}": t.contiguous() for i, t in enumerate(logits)}
        tensors["load"] = load
        save_file(tensors, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "replicated"),
    [
        (2, False),
        pytest.param(4, False, marks=pytest.mark.slow),
        pytest.param(2, True, marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_matches_single_rank(reference, tmp_path: Path, world: int, replicated: bool) -> None:
    """Each rank runs its own sequence (DP attention); replicated = EPLB-style redundant experts."""
    path, _ = reference(NAME)
    single = ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1))
    run_ranks(_worker, world, world, str(path), str(tmp_path), replicated, timeout_s=240)
    for rank in range(world):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        want, load = _steps(single, rank)
        for i, w in enumerate(want):
            assert (got[f"step{i}"] - w).abs().max().item() < 1e-4, f"rank {rank} step {i}"
        assert torch.equal(got["load"], load), "per-layer expert load counters differ from one rank's"


#: how late rank 1 sends its rows in the overlap test
LATE_S = 1.0


class _LateRows(AllToAllDispatch):
    """Sends its rows ``LATE_S`` late: the other rank's exchange is then in flight that long."""

    def _start(self, send, send_splits, recv_splits):
        time.sleep(LATE_S)
        return super()._start(send, send_splits, recv_splits)


def _experts(rank: int, world: int) -> tuple[Experts, Experts]:
    """(all 8 experts, this rank's 8 / world), the same seeded values on every rank."""
    g = torch.Generator().manual_seed(0)
    full = Experts(8, 32, 16, limit=7.0)
    full.gate_up_proj.data = torch.randn(8, 32, 32, generator=g)
    full.down_proj.data = torch.randn(8, 32, 16, generator=g)
    per = 8 // world
    mine = Experts(per, 32, 16, limit=7.0, first_physical=rank * per)
    mine.gate_up_proj.data = full.gate_up_proj.data[rank * per : (rank + 1) * per].clone()
    mine.down_proj.data = full.down_proj.data[rank * per : (rank + 1) * per].clone()
    return full, mine


def _overlap_worker(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    import torch.distributed as dist

    join_group("gloo", rendezvous, rank, world)
    try:
        torch.set_num_threads(1)
        full, mine = _experts(rank, world)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(20, 32, generator=g)
        phys = torch.randint(0, 8, (20, 2), generator=g)
        weights = torch.rand(20, 2, generator=g)
        shared = torch.randn(20, 32, generator=g)
        dispatch = AllToAllDispatch(None, world) if rank == 0 else _LateRows(None, world)
        times: dict[str, float] = {}

        def alongside() -> torch.Tensor:
            times["alongside"] = time.perf_counter() - t0
            return shared

        dist.barrier()  # both ranks start the layer together
        t0 = time.perf_counter()
        with torch.no_grad():
            got = dispatch(x, phys, weights, mine, alongside=alongside)
            times["end"] = time.perf_counter() - t0
            want = local_dispatch(x, phys, weights, full, alongside=lambda: shared)
        times["max_diff"] = (got - want).abs().max().item()
        Path(out_dir, f"overlap{rank}.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def test_the_routed_rows_travel_while_the_shared_expert_computes(tmp_path: Path) -> None:
    """Rank 1 sends its rows late: rank 0 computes its ``alongside`` (the shared expert) before
    they arrive, not after, and both ranks' outputs equal one rank's (routed + shared)."""
    store = rendezvous_file()
    mp.start_processes(
        _overlap_worker, args=(2, store.path, str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    first = json.loads((tmp_path / "overlap0.json").read_text())
    assert first["end"] >= LATE_S * 0.9, first  # rank 0 waited for rank 1's rows
    assert first["alongside"] < LATE_S / 2, first  # and computed the shared expert meanwhile
    for rank in range(2):
        done = json.loads((tmp_path / f"overlap{rank}.json").read_text())
        assert done["max_diff"] < 1e-4, (rank, done)
