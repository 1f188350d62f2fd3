"""The engine's CUDA path: the same code as on CPU (tests/unit/engine) gives the same logits, and
V4-Flash widths run a mixed prefill/decode batch in bf16."""

from __future__ import annotations

import time

import torch

from engine.checkpoint.generate import generate_checkpoint
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig


def _chunked(runner: ModelRunner, ids: list[int], chunks: list[int]) -> list[torch.Tensor]:
    out, pos = [], 0
    for c in chunks:
        seq = SequenceInput(ids[pos : pos + c], pos, 0, [0, 1])
        out.append(
            runner.execute(ForwardBatch.from_sequences([seq], device=runner.cfg.device)).logits[0].cpu()
        )
        pos += c
    return out


def test_cuda_matches_cpu_on_tiny_fp32(tmp_path) -> None:
    path = generate_checkpoint("tiny", tmp_path / "tiny").path
    ids = list(range(3, 3 + 300))
    chunks = [100, 150, 47, 1, 1, 1]
    cpu = _chunked(ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1)), ids, chunks)
    gpu = _chunked(ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1, device="cuda")), ids, chunks)
    for a, b in zip(cpu, gpu):
        assert (a - b).abs().max().item() < 1e-3


def test_flash_widths_mixed_batch_bf16(tmp_path) -> None:
    path = generate_checkpoint("flash-shape", tmp_path / "f", num_hidden_layers=4, n_routed_experts=16).path
    runner = ModelRunner(path, RunnerConfig(num_blocks=16, num_slots=8, dtype="bfloat16", device="cuda"))
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((300, 200, 520, 90))]
    seqs = [SequenceInput(p, 0, i, [2 * i, 2 * i + 1, 8 + i]) for i, p in enumerate(prompts)]
    logits = runner.execute(ForwardBatch.from_sequences(seqs, device="cuda")).logits
    assert logits.shape == (4, 129280) and torch.isfinite(logits).all()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 8
    for s in range(steps):
        dec = [SequenceInput([7], len(p) + s, i, [2 * i, 2 * i + 1, 8 + i]) for i, p in enumerate(prompts)]
        logits = runner.execute(ForwardBatch.from_sequences(dec, device="cuda")).logits
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"flash widths, 4 layers, batch 4 decode: {ms:.1f} ms/step")
    assert torch.isfinite(logits).all()


def test_cuda_keeps_fp4_fp8_weights_quantised(tmp_path) -> None:
    path = generate_checkpoint(
        "tiny", tmp_path / "q", quant="fp4", hidden_size=128, moe_intermediate_size=64
    ).path
    ids = list(range(3, 201))  # 198 tokens: two prefill chunks, then one decode step
    chunks = [150, 47, 1]
    cpu = _chunked(ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1)), ids, chunks)
    cfg = RunnerConfig(num_blocks=2, num_slots=1, device="cuda", keep_quantized=True)
    gpu = _chunked(ModelRunner(path, cfg), ids, chunks)
    for a, b in zip(cpu, gpu):
        assert (a - b).abs().max().item() < 1e-3
