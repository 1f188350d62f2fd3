"""EP2 over NCCL (2 processes, one GPU each) gives the logits of one GPU holding every expert.

Each rank runs its own sequence (data-parallel attention): a prefill in two chunks, then two
decode tokens; the single GPU runs the same sequences one after the other.

- fp32, tiny checkpoint read from safetensors (each rank loads only its experts): max |diff|
  of the logits < 1e-4 (TF32 off, the default for fp32 matmuls).
- bf16, V4-Flash widths (hidden 4096, 64 heads, expert width 2048; 16 routed experts, top-6;
  seeded random weights drawn on each GPU): relative L2 error ||ep - one|| / ||one|| of every
  step's logits < 2e-2. bf16 keeps 8 bits of mantissa (eps 7.8e-3); the EP path sums each
  token's expert outputs in another order (all-to-all order, atomic index_add), which moves
  results by a few bf16 ulps per layer. A wrong expert or a lost row gives an error of order 1.
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
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from services.procs import free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

WORLD = 2
FLASH = {"num_hidden_layers": 2, "n_routed_experts": 16}  # one hash-MoE + one CSA layer


def _prompt(rank: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, vocab, (200 + 37 * rank,), generator=g).tolist()


def _steps(runner: ModelRunner, rank: int) -> list[torch.Tensor]:
    ids = _prompt(rank, runner.model_cfg.vocab_size)
    cut = [0, 150, len(ids) - 2, len(ids) - 1, len(ids)]
    out = []
    for a, b in zip(cut, cut[1:]):
        batch = ForwardBatch.from_sequences([SequenceInput(ids[a:b], a, 0, [0])], device=runner.cfg.device)
        out.append(runner.execute(batch).logits[0].float().cpu())
    return out


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


def _worker(rank: int, port: int, case: str, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        dist.all_reduce(torch.zeros(1, device=f"cuda:{rank}"))
        runner = _runner(case, path, WORLD, rank, f"cuda:{rank}")
        logits = _steps(runner, rank)
        tensors = {f"step{i}": t.contiguous() for i, t in enumerate(logits)}
        tensors["load"] = runner.expert_load().cpu()
        save_file(tensors, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["tiny_fp32", "flash_bf16"])
def test_ep2_nccl_matches_one_gpu(case: str, tmp_path: Path) -> None:
    path = str(generate_checkpoint("tiny", tmp_path / "tiny").path) if case == "tiny_fp32" else ""
    mp.spawn(_worker, args=(free_port(), case, path, str(tmp_path)), nprocs=WORLD, join=True)
    single = _runner(case, path, 1, 0, "cuda:0")
    worst = 0.0
    for rank in range(WORLD):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        want = _steps(single, rank)
        for i, w in enumerate(want):
            g = got[f"step{i}"]
            assert torch.isfinite(g).all()
            if case == "tiny_fp32":
                err = (g - w).abs().max().item()
                assert err < 1e-4, f"rank {rank} step {i}: max |diff| {err}"
            else:
                err = ((g - w).norm() / w.norm()).item()
                assert err < 2e-2, f"rank {rank} step {i}: relative L2 {err}"
            worst = max(worst, err)
        assert torch.equal(got["load"], single.expert_load().cpu()), "expert load counters differ"
    print(f"\n{case}: worst {'max |diff|' if case == 'tiny_fp32' else 'relative L2'} = {worst:.3e}")
