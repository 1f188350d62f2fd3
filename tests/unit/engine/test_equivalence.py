"""Sluice's engine vs the transformers DeepSeek-V4 reference on tiny random checkpoints (fp32).

``index_topk`` is 512 (>= every entry count) in two checkpoints, so CSA selection is exact; the
third (``csa_small_topk``, top-4) exercises real top-k selection; its scores are computed in the
same order in both implementations, and the test asserts equality of logits, which would fail
on a selection flip.
"""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from tests.unit.engine.conftest import ALL, reference_logits

TOL = 1e-4


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _runner(path, slots: int = 4, blocks: int = 16) -> ModelRunner:
    return ModelRunner(path, RunnerConfig(num_blocks=blocks, num_slots=slots))


def _all_position_logits(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    m = runner.model
    with torch.no_grad():
        return m.lm_head(m.model.norm(m.model.hc_head(hidden))).float()


@pytest.mark.parametrize("name", ALL)
def test_full_prompt_logits_match_reference(reference, name: str) -> None:
    path, ref = reference(name)
    ids = _ids(150, 1)
    want = reference_logits(ref, ids)
    runner = _runner(path)
    out = runner.execute(ForwardBatch.from_sequences([SequenceInput(ids.tolist(), 0, 0, [0])]))
    got = _all_position_logits(runner, out.hidden)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL
    assert (out.logits[0] - want[-1]).abs().max().item() < TOL


@pytest.mark.parametrize("name", ALL)
def test_chunked_prefill_then_decode_matches_reference(reference, name: str) -> None:
    path, ref = reference(name)
    chunks = [1, 6, 31, 4, 64, 3]  # crosses window (16/128), CSA (4) and HCA (16/128) boundaries
    n_decode = 12
    ids = _ids(sum(chunks) + n_decode, 2)
    want = reference_logits(ref, ids)
    runner = _runner(path)
    pos = 0
    for c in chunks + [1] * n_decode:
        seq = SequenceInput(ids[pos : pos + c].tolist(), pos, 2, [3])
        out = runner.execute(ForwardBatch.from_sequences([seq]))
        pos += c
        err = (out.logits[0] - want[pos - 1]).abs().max().item()
        assert err < TOL, f"position {pos - 1}: max |diff| {err}"


@pytest.mark.parametrize("name", ALL)
def test_mixed_batch_matches_reference(reference, name: str) -> None:
    """Three sequences of different lengths; prefill chunks and 1-token decode steps mixed in each step."""
    path, ref = reference(name)
    lens = [74, 27, 142]
    prompts = [_ids(n, 10 + i) for i, n in enumerate(lens)]
    wants = [reference_logits(ref, p) for p in prompts]
    # per step, tokens each sequence contributes (0 = not scheduled)
    plan = [[20, 23, 1], [30, 1, 50], [20, 1, 7], [1, 1, 60], [1, 1, 22], [1, 0, 1], [1, 0, 1]]
    runner = _runner(path, slots=4)
    done = [0, 0, 0]
    for step in plan:
        seqs, who = [], []
        for i, c in enumerate(step):
            if c:
                seqs.append(
                    SequenceInput(
                        prompts[i][done[i] : done[i] + c].tolist(), done[i], i + 1, [2 * i, 2 * i + 1]
                    )
                )
                who.append(i)
        out = runner.execute(ForwardBatch.from_sequences(seqs))
        for row, i in enumerate(who):
            done[i] += step[i]
            err = (out.logits[row] - wants[i][done[i] - 1]).abs().max().item()
            assert err < TOL, f"seq {i} position {done[i] - 1}: max |diff| {err}"
    assert done == lens
