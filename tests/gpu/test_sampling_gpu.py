"""Sampling on the device (engine/sampling/sampler.py `sample_rows`): batch invariant on the
GPU, and agreeing with the CPU's draws up to rounding."""

from __future__ import annotations

import torch

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import draw_seed, sample_rows

V = 129_280


def _params(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=(0.3, 0.8, 1.0, 1.7)[i % 4],
            top_k=(0, 1, 20, 400)[(i // 4) % 4],
            top_p=(1.0, 0.9, 0.5)[(i // 16) % 3],
            min_p=(0.0, 0.05)[(i // 48) % 2],
        )
        for i in range(n)
    ]


def test_device_draws_are_batch_invariant_and_match_the_cpu() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(200, V, generator=gen) * 4).to(torch.bfloat16)
    params = _params(200)
    seeds = [draw_seed(900 + i, 11) for i in range(200)]
    gpu = logits.cuda()
    together = sample_rows(gpu, params, seeds)
    for size in (1, 7, 64):
        for start in (0, 100):
            picked = list(range(start, start + size))
            got = sample_rows(gpu[picked], [params[i] for i in picked], [seeds[i] for i in picked])
            assert got == [together[i] for i in picked], (size, start)
    cpu = sample_rows(logits, params, seeds)
    agree = sum(a == b for a, b in zip(together, cpu)) / len(cpu)
    print(f"GPU vs CPU draws agree on {agree:.3f} of 200 rows")
    assert agree >= 0.95
