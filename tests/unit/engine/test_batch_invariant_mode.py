"""The batch-invariant mode's pieces that run without a GPU (its kernels and end-to-end
checks: tests/gpu/test_batch_invariance_gpu.py)."""

from __future__ import annotations

import pytest

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.kernels import batch_invariant, triton_available
from engine.model import verify


@pytest.mark.skipif(triton_available(), reason="checks the error where Triton is missing")
def test_the_mode_says_it_needs_triton(tmp_path) -> None:
    from engine.engine_config import EngineConfig

    with pytest.raises(RuntimeError, match="needs Triton"):
        batch_invariant.enable()
    assert not batch_invariant.enabled()
    with pytest.raises(ValueError, match="needs Triton"):
        EngineConfig(model=str(tmp_path), device="cuda", batch_invariant=True)


def test_the_mode_wants_a_token_budget_of_at_least_a_block(tmp_path) -> None:
    from engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 256"):
        EngineConfig(model=str(tmp_path), batch_invariant=True, max_num_batched_tokens=128)


def test_the_k_split_depends_on_the_output_and_reduced_widths_only() -> None:
    import torch

    cpu = torch.device("cpu")  # the interpreter's stand-in: an H200's 132 multiprocessors
    split, per = batch_invariant.k_split(1024, 4096, 2, cpu)
    assert split * per >= 4096 and per % batch_invariant.TILES[2][2] == 0
    assert per >= batch_invariant.MIN_K_PER_SPLIT
    assert batch_invariant.k_split(129280, 4096, 2, cpu) == (1, 4096)  # wide outputs fill the GPU


def test_the_tile_map_never_mixes_experts_and_is_built_once_per_grouping(monkeypatch) -> None:
    import torch

    from engine.kernels import grouped

    row_end = torch.tensor([3, 3, 8, 9], dtype=torch.int32)  # 3, 0, 5 and 1 rows; bm 4
    expert, row = grouped.tile_map(row_end, 9, 4)
    real = expert < 4
    assert expert[real].tolist() == [0, 2, 2, 3] and row[real].tolist() == [0, 3, 7, 8]
    assert (expert[~real] == 4).all()  # the worst-case tail: past the last tile

    built = []
    monkeypatch.setattr(grouped, "tile_map", lambda *a: built.append(a) or (expert, row))
    maps: grouped.TileMaps = {}
    first = grouped.shared_tile_map(row_end, 9, 4, maps)
    assert grouped.shared_tile_map(row_end, 9, 4, maps) is first  # the down product
    grouped.shared_tile_map(row_end, 9, 8, maps)  # another tile height: its own map
    grouped.shared_tile_map(row_end, 9, 4, None)  # no sharing asked: built again
    assert len(built) == 3


def test_in_the_mode_short_prompt_chunks_leave_the_verification_path(monkeypatch) -> None:
    """A prompt of at most 8 tokens would take the verification path alone and the general
    path beside a longer prompt; in the mode only decode and verification rows take it."""
    short_prompt = ForwardBatch.from_sequences([SequenceInput([5, 6, 7], 0, 0, [0])])
    verifying = ForwardBatch.from_sequences(
        [SequenceInput([5, 6, 7], 10, 0, [0], num_logits=3), SequenceInput([8], 4, 1, [1])]
    )
    assert verify.applies(short_prompt) and verify.applies(verifying)
    monkeypatch.setattr(batch_invariant, "enabled", lambda: True)
    assert not verify.applies(short_prompt)
    assert verify.applies(verifying)
