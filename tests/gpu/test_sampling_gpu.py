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


def test_masked_rows_on_the_device_are_batch_invariant_and_match_the_cpu() -> None:
    """`draw_masked` (grammar masks and penalties, the pipelined executor's path) on the GPU:
    a row's token is the same in any sub-batch, never outside its mask, and agrees with the
    host's `sample_row` up to rounding; queuing it never synchronises."""
    from engine.sampling.sampler import RowInput, draw_masked, sample_row

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(96, V, generator=gen) * 4).to(torch.bfloat16)
    rows = []
    for i, p in enumerate(_params(96)):
        p = SamplingParams(
            temperature=0.0 if i % 3 == 0 else p.temperature, top_k=p.top_k, top_p=p.top_p,
            repetition_penalty=(1.0, 1.2)[i % 2], presence_penalty=(0.0, 0.5)[i // 2 % 2], frequency_penalty=0.1 * (i % 3),
        )  # fmt: skip
        mask = None if i % 4 == 0 else torch.rand(V, generator=gen) < 0.3
        out = [int(t) for t in torch.randint(0, V, (i % 11,), generator=gen)]
        rows.append(RowInput(p, 70 + i, len(out), [1, 2, 3], out, mask))
    gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = draw_masked(gpu, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    together = queued.tolist()
    for size, start in ((1, 0), (7, 40), (64, 20)):
        picked = list(range(start, start + size))
        assert draw_masked(gpu[picked], [rows[i] for i in picked]).tolist() == together[start : start + size]
    assert all(r.allowed_mask is None or bool(r.allowed_mask[t]) for r, t in zip(rows, together))
    cpu = [sample_row(logits[i], rows[i]).token_id for i in range(96)]
    agree = sum(a == b for a, b in zip(together, cpu)) / len(cpu)
    print(f"masked rows: GPU vs CPU agree on {agree:.3f} of 96 rows")
    assert agree >= 0.95
