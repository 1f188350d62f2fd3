"""ForwardBatch invariants: flattened layout, sampled rows, and actionable errors."""

from __future__ import annotations

import pytest

from engine.forward_batch import ForwardBatch, SequenceInput


def test_flattened_layout_and_sample_rows() -> None:
    b = ForwardBatch.from_sequences(
        [
            SequenceInput([5, 6, 7], 0, 0, [0], sample=False),  # a prefill chunk that does not end the prompt
            SequenceInput([9], 300, 1, [1, 2]),  # a decode token in its second block
            SequenceInput([1, 2], 10, 2, [3]),
        ]
    )
    assert b.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert b.positions.tolist() == [0, 1, 2, 300, 10, 11]
    assert b.query_start.tolist() == [0, 3, 4] and b.query_len.tolist() == [3, 1, 2]
    assert b.sample_indices.tolist() == [3, 5]
    assert b.block_table.tolist() == [[0, -1], [1, 2], [3, -1]]
    assert not b.is_decode


@pytest.mark.parametrize(
    ("seqs", "match"),
    [
        ([], "at least one sequence"),
        ([SequenceInput([], 0, 0, [0])], "at least one token"),
        ([SequenceInput([1], 256, 0, [0])], "block_table has 1 blocks"),
        ([SequenceInput([1], 0, 0, [0]), SequenceInput([2], 0, 0, [1])], "share a sliding-window slot"),
    ],
)
def test_invalid_batches_are_rejected(seqs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ForwardBatch.from_sequences(seqs)
