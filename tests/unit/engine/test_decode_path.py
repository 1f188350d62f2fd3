"""The vectorised decode path (one token per sequence, no per-sequence loop): many sequences of
different lengths decoding together across window, CSA and HCA boundaries.

Against the reference on all three checkpoints (one with a real top-4 selection, tie-free); and
against the general per-sequence path on a checkpoint with 2 indexer heads, where ReLU scores
tie at 0 on the top-k boundary and transformers' ``topk`` breaks ties its own way (seen: 0.64
logit difference). Sluice breaks ties toward the lowest entry index, the same in every path
and batch composition.
"""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import ALL, reference_logits

PROMPTS, STEPS = [1, 3, 14, 30, 47], 20


def _seqs() -> list[list[int]]:
    return [
        torch.randint(0, 256, (n + STEPS,), generator=torch.Generator().manual_seed(20 + i)).tolist()
        for i, n in enumerate(PROMPTS)
    ]


def _decode_all(path, seqs: list[list[int]], steps: int = STEPS) -> list[torch.Tensor]:
    """Prefill every prompt in one batch, then STEPS decode steps of the whole batch: logits per step."""
    runner = ModelRunner(path, RunnerConfig(num_blocks=len(seqs), num_slots=len(seqs)))
    prefill = [SequenceInput(s[:n], 0, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
    runner.execute(ForwardBatch.from_sequences(prefill))
    out = []
    for t in range(steps):
        dec = [SequenceInput([s[n + t]], n + t, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
        batch = ForwardBatch.from_sequences(dec)
        out.append(runner.execute(batch).logits)
    return out


@pytest.mark.parametrize(
    "name", [n if n == "mixed_hc2" else pytest.param(n, marks=pytest.mark.slow) for n in ALL]
)
def test_batched_decode_matches_reference(reference, name: str) -> None:
    path, ref = reference(name)
    seqs = _seqs()
    wants = [reference_logits(ref, torch.tensor(s)) for s in seqs]
    for t, logits in enumerate(_decode_all(path, seqs)):
        for i, n in enumerate(PROMPTS):
            err = (logits[i] - wants[i][n + t]).abs().max().item()
            assert err < 1e-4, f"seq {i} position {n + t}: {err}"


def test_batched_decode_equals_per_sequence_path_with_topk_ties(reference, monkeypatch) -> None:
    path, _ = reference("csa_ties")
    seqs = _seqs()
    fast = _decode_all(path, seqs, steps=10)
    monkeypatch.setattr(ForwardBatch, "is_decode", property(lambda self: False))
    slow = _decode_all(path, seqs, steps=10)
    for t, (a, b) in enumerate(zip(fast, slow)):
        assert (a - b).abs().max().item() < 1e-5, f"step {t}"


def test_take_rows_is_advanced_indexing_by_whole_rows() -> None:
    """`take_rows(store, outer, inner)` gives ``store[outer, inner]`` exactly, for the shapes the
    decode and verification paths index with (a column against a row of indices, a row
    against a block table), on contiguous stores and, by falling back, on strided ones."""
    from engine.model.decode import take_rows

    g = torch.Generator().manual_seed(0)
    store = torch.randn(6, 8, 5, generator=g).to(torch.bfloat16)
    outer = torch.randint(0, 6, (7, 1), generator=g)
    inner = torch.randint(0, 8, (7, 4), generator=g)
    for s in (store, store.transpose(0, 1).contiguous().transpose(0, 1)):  # the second is strided
        got = take_rows(s, outer, inner)
        assert got.shape == (7, 4, 5) and torch.equal(got, s[outer, inner])
    table = torch.randint(0, 6, (3, 9), generator=g)
    rows = torch.arange(9)[None, :] % 8
    assert torch.equal(take_rows(store, table, rows), store[table, rows])
