"""Verification sampling (``Speculation.verify``) on a small vocabulary, over many seeds:

* the tokens equal plain sequential sampling with the same seed;
* the first token follows the target distribution, and so does the second given that the
  first draft was accepted (chi-squared, alpha = 0.001);
* a draft is accepted with probability p(draft), which is what standard rejection sampling
  accepts a greedy (one-hot) draft with: the shared noise costs no acceptance here;
* the same test rejects a sampler that favours the draft (it has the power to fail).
"""

from __future__ import annotations

import math
import random

import torch

from engine.executor import ModelExecutor
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowInput, sample_row
from engine.scheduler.output import ScheduledSeq
from engine.step_state import SamplingState

V, N = 8, 3000
PARAMS = SamplingParams(temperature=0.9, max_tokens=64)


def _rows() -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 1.5


def _probs(row: torch.Tensor) -> list[float]:
    return torch.softmax(row / PARAMS.temperature, dim=0).tolist()


def _verify(rows: torch.Tensor, drafts: tuple[int, int], seed: int) -> list[int]:
    ex = ModelExecutor(runner=None)  # type: ignore[arg-type]  # verification samples only
    ex.add("r", SamplingState(PARAMS, seed, [1, 2, 3]))
    seq = ScheduledSeq(
        "r", (4, *drafts), 10, (0,), 0, False, 0, 0, (0, 0), (), sample=True, output_index=0, num_drafts=2
    )
    return ex.speculation.verify(seq, rows, rows.argmax(-1).tolist(), ex._sample)[0]


def _plain(rows: torch.Tensor, drafts: tuple[int, int], seed: int) -> list[int]:
    out: list[int] = []
    for j in range(3):
        out.append(sample_row(rows[j], RowInput(PARAMS, seed, j, [1, 2, 3], list(out))).token_id)
        if j == 2 or out[-1] != drafts[j]:
            return out
    return out


def _chi2(counts: list[int], probs: list[float]) -> tuple[float, float]:
    """Statistic and the alpha = 0.001 critical value (Wilson-Hilferty) over bins with
    expected count >= 5 (the rest pooled)."""
    n = sum(counts)
    bins: list[tuple[float, float]] = []
    pool = [0.0, 0.0]
    for c, p in zip(counts, probs):
        if n * p >= 5:
            bins.append((c, n * p))
        else:
            pool[0] += c
            pool[1] += n * p
    if pool[1] > 0:
        bins.append((pool[0], pool[1]))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    z = 3.0902  # upper 0.001 quantile of N(0, 1)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def _draw_all() -> tuple[list[list[int]], tuple[int, int]]:
    rows = _rows()
    p0 = _probs(rows[0])
    d1 = max(range(V), key=lambda t: p0[t])  # the greedy draft: accepted often enough to test
    d2 = max(range(V), key=lambda t: _probs(rows[1])[t])
    return [_verify(rows, (d1, d2), seed) for seed in range(N)], (d1, d2)


def test_verification_equals_plain_sampling_and_keeps_the_target_distribution() -> None:
    rows = _rows()
    outs, (d1, d2) = _draw_all()
    for seed in range(0, N, 7):
        assert outs[seed] == _plain(rows, (d1, d2), seed), seed
    first = [o[0] for o in outs]
    stat, crit = _chi2([first.count(t) for t in range(V)], _probs(rows[0]))
    assert stat < crit, (stat, crit)
    second = [o[1] for o in outs if o[0] == d1]
    stat, crit = _chi2([second.count(t) for t in range(V)], _probs(rows[1]))
    assert stat < crit, (stat, crit)
    p = _probs(rows[0])[d1]  # rejection sampling's acceptance of a one-hot draft: min(1, p/1)
    rate = len(second) / N
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / N), (rate, p)


def test_the_chi_squared_check_rejects_a_sampler_that_favours_the_draft() -> None:
    rows = _rows()
    p0 = _probs(rows[0])
    d1 = max(range(V), key=lambda t: p0[t])
    rng = random.Random(0)
    # accept the draft outright 20 % of the time, else sample: a plausible-looking bias
    biased = [d1 if rng.random() < 0.2 else _plain(rows, (d1, 0), seed)[0] for seed in range(N)]
    stat, crit = _chi2([biased.count(t) for t in range(V)], p0)
    assert stat > crit, (stat, crit)
