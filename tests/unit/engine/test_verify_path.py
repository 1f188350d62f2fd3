"""The vectorised path for a few tokens per sequence (speculative verification): ragged steps
of 1 to 6 tokens per sequence, across window, CSA and HCA boundaries, equal the reference and
the general per-sequence path, including the logits of every token of a step (num_logits)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model import verify
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import ALL, reference_logits

PROMPTS, TOKENS = [1, 3, 14, 30, 47], 40


def _seqs() -> list[list[int]]:
    return [
        torch.randint(0, 256, (n + TOKENS,), generator=torch.Generator().manual_seed(40 + i)).tolist()
        for i, n in enumerate(PROMPTS)
    ]


def _ragged(path, seqs: list[list[int]], seed: int = 0) -> dict[tuple[int, int], torch.Tensor]:
    """Prefill, then steps of 1-6 teacher-forced tokens per sequence: logits per (seq, position)."""
    rng = random.Random(seed)
    runner = ModelRunner(path, RunnerConfig(num_blocks=len(seqs), num_slots=len(seqs)))
    runner.execute(
        ForwardBatch.from_sequences(
            [SequenceInput(s[:n], 0, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
        )
    )
    done = list(PROMPTS)
    out: dict[tuple[int, int], torch.Tensor] = {}
    while any(d < n + TOKENS for d, n in zip(done, PROMPTS)):
        seqs_in, who = [], []
        for i, (s, n) in enumerate(zip(seqs, PROMPTS)):
            q = min(rng.randint(1, 6), n + TOKENS - done[i])
            if q <= 0:
                continue
            seqs_in.append(SequenceInput(s[done[i] : done[i] + q], done[i], i, [i], num_logits=q))
            who.append((i, done[i], q))
        logits = runner.execute(ForwardBatch.from_sequences(seqs_in)).logits
        row = 0
        for i, n0, q in who:
            for j in range(q):
                out[(i, n0 + j)] = logits[row]
                row += 1
            done[i] += q
    return out


@pytest.mark.parametrize(
    "name", [n if n == "mixed_hc2" else pytest.param(n, marks=pytest.mark.slow) for n in ALL]
)
def test_ragged_steps_match_reference(reference, name: str) -> None:
    path, ref = reference(name)
    seqs = _seqs()
    wants = [reference_logits(ref, torch.tensor(s)) for s in seqs]
    for (i, p), logits in _ragged(path, seqs).items():
        err = (logits - wants[i][p]).abs().max().item()
        assert err < 1e-4, f"seq {i} position {p}: {err}"


def test_ragged_steps_equal_the_per_sequence_path(reference, monkeypatch) -> None:
    path, _ = reference("csa_ties")
    seqs = _seqs()
    fast = _ragged(path, seqs, seed=3)
    monkeypatch.setattr(verify, "applies", lambda batch: False)
    slow = _ragged(path, seqs, seed=3)
    assert fast.keys() == slow.keys()
    for key in fast:
        assert (fast[key] - slow[key]).abs().max().item() < 1e-5, key
