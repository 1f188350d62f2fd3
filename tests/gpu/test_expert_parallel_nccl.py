"""EP2 over NCCL (2 processes, one GPU each) gives the logits of one GPU holding every expert.

Each rank runs its own sequence (data-parallel attention): a prefill in two chunks, then two
decode tokens; the single GPU runs the same sequences one after the other.

- fp32, tiny checkpoint read from safetensors (each rank loads only its experts): max |diff|
  of the logits < 1e-4 (TF32 off, the default for fp32 matmuls).
- bf16, V4-Flash widths (hidden 4096, 64 heads, expert width 2048; 16 routed experts, top-6;
  seeded random weights drawn on each GPU): relative L2 error ||ep - one|| / ||one|| of every
  step's logits < 2e-2 where the step routed every token to the same experts as one GPU did
  (at most one step of eight may differ: a top-k near-tie flipped by bf16 rounding). Both paths
  combine expert outputs in the same fixed order (`engine.model.moe.combine`); what remains is
  the grouped GEMM over other row groupings. A wrong expert or a lost row gives an error of
  order 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine.checkpoint.generate import generate_checkpoint
from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from engine.distributed.rendezvous import join_group, rendezvous_file
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

WORLD = 2
FLASH = {"num_hidden_layers": 2, "n_routed_experts": 16}  # one hash-MoE + one CSA layer


def _prompt(rank: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab, (200 + 37 * rank,), generator=g).tolist()


def _steps(runner: ModelRunner, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits [vocab] and expert load [layers, experts] (this rank's routing) of each step."""
    ids = _prompt(rank, runner.model_cfg.vocab_size)
    cut = [0, 150, len(ids) - 2, len(ids) - 1, len(ids)]
    logits, loads = [], []
    for a, b in zip(cut, cut[1:]):
        batch = ForwardBatch.from_sequences([SequenceInput(ids[a:b], a, 0, [0])], device=runner.cfg.device)
        logits.append(runner.execute(batch).logits[0].float().cpu())
        loads.append(runner.expert_load().cpu())
    return logits, loads


def _runner(case: str, path: str, world: int, rank: int, device: str) -> ModelRunner:
    if case == "tiny_fp32":
        cfg = RunnerConfig(num_blocks=1, num_slots=1, device=device, ep_size=world, ep_rank=rank)
        return ModelRunner(path, cfg)
    cfg = RunnerConfig(
        num_blocks=1,
        num_slots=1,
        dtype="bfloat16",
        device=device,
        with_mtp=False,
        ep_size=world,
        ep_rank=rank,
    )
    return ModelRunner.random(ModelConfig.from_dict(preset_config("flash-shape", **FLASH)), cfg, seed=3)


def _worker(rank: int, rendezvous: str, case: str, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    torch.cuda.set_device(rank)
    join_group("nccl", rendezvous, rank, WORLD)
    try:
        dist.all_reduce(torch.zeros(1, device=f"cuda:{rank}"))
        runner = _runner(case, path, WORLD, rank, f"cuda:{rank}")
        logits, loads = _steps(runner, rank)
        tensors = {f"step{i}": t.contiguous() for i, t in enumerate(logits)}
        tensors |= {f"load{i}": t.contiguous() for i, t in enumerate(loads)}
        save_file(tensors, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["tiny_fp32", "flash_bf16"])
def test_ep2_nccl_matches_one_gpu(case: str, tmp_path: Path) -> None:
    path = str(generate_checkpoint("tiny", tmp_path / "tiny").path) if case == "tiny_fp32" else ""
    store = rendezvous_file()  # the ranks' rendezvous, held until they are done
    mp.spawn(_worker, args=(store.path, case, path, str(tmp_path)), nprocs=WORLD, join=True)
    single = _runner(case, path, 1, 0, "cuda:0")
    errs, same_routing = [], []
    for rank in range(WORLD):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        want, loads = _steps(single, rank)
        for i, w in enumerate(want):
            g = got[f"step{i}"]
            assert torch.isfinite(g).all()
            same_routing.append(torch.equal(got[f"load{i}"], loads[i]))
            if case == "tiny_fp32":
                err = (g - w).abs().max().item()
                assert err < 1e-4, f"rank {rank} step {i}: max |diff| {err}"
                assert same_routing[-1], f"rank {rank} step {i}: expert choices differ"
            else:
                err = ((g - w).norm() / w.norm()).item()
                # a top-k near-tie flipped by bf16 rounding routes one token to another expert: that is
                # not an EP error, but it changes that step's logits; allow it on at most one step
                if same_routing[-1]:
                    assert err < 2e-2, f"rank {rank} step {i}: relative L2 {err}"
            errs.append(err)
    print(f"\n{case}: per-step errors {[f'{e:.2e}' for e in errs]}, same expert choices {same_routing}")
    assert sum(not s for s in same_routing) <= (0 if case == "tiny_fp32" else 1)
