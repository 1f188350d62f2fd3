"""The drafting chain as the CUDA graphs shape it (`engine.spec.draft_graphs.DraftGraphs`, run
eagerly here with ``decode_graphs="padded"``; captured in tests/gpu): after a verification
step, pass 1 holds the runs' tokens packed, not every row padded to the longest run."""

from __future__ import annotations

import pytest

from engine.cuda_graphs import MAX_GRAPH_QUERY, batch_bucket, token_bucket
from engine.spec.draft_graphs import DraftGraphs
from tests.unit.engine.spec.drafting import prefilled, verify_step

# (tokens each sequence brings to the verification step, drafts wanted after it)
CASES = {
    # four rows: two padding tokens follow the last row's, which is real
    "padding tokens on a real row": ((3, 1, 6, 1), (5, 2, 4, 1)),
    # nine rows in a bucket of ten: the padding tokens sit on the padding row
    "a padding row": ((3, 1, 6, 2, 1, 4, 1, 5, 3), (5, 2, 4, 1, 3, 5, 2, 1, 4)),
}

Steps = list[dict[str, tuple[tuple[int, ...], tuple[float, ...]]]]


def _steps(case: str, mode: str) -> Steps:
    """The drafts and confidences after the verification step of ``case``, then after a decode
    step of every sequence (which reads the MTP windows the first chain wrote)."""
    tokens, wanted = CASES[case]
    runner, drafter, seqs = prefilled(mode, seed=11, prompts=[20 + 7 * i for i in range(len(tokens))])
    got = [drafter.draft(*verify_step(runner, seqs, tokens, wanted)).result()]
    got.append(
        drafter.draft(*verify_step(runner, seqs, [1] * len(tokens), [3] * len(tokens), tokens)).result()
    )
    return [{k: (d.tokens, d.confidence) for k, d in step.items()} for step in got]


@pytest.mark.parametrize("case", list(CASES))
def test_a_verification_steps_runs_draft_packed_as_they_draft_eagerly(case: str, monkeypatch) -> None:
    """The padded chain drafts what the eager chain drafts, with the same confidences, and its
    first pass holds ``token_bucket(T, rows)`` tokens. Padding tokens write only the scratch
    slot: had they written a real row's MTP window, the next step's drafts would differ."""
    shapes: list[tuple[int, int, int, int]] = []
    build = DraftGraphs._build

    def recorded(self: DraftGraphs, b: int, q: int, t: int, depth: int) -> object:
        shapes.append((b, q, t, depth))
        return build(self, b, q, t, depth)

    eager = _steps(case, "off")
    monkeypatch.setattr(DraftGraphs, "_build", recorded)
    packed = _steps(case, "padded")
    tokens, wanted = CASES[case]
    for step, (a, b) in enumerate(zip(eager, packed)):
        assert a.keys() == b.keys() == {str(i) for i in range(len(tokens))}
        for rid, (drafts, conf) in a.items():
            assert b[rid][0] == drafts, (step, rid)
            assert b[rid][1] == pytest.approx(conf, rel=1e-4, abs=1e-5)
    assert [len(packed[0][str(i)][0]) for i in range(len(tokens))] == list(wanted)
    rows = batch_bucket(len(tokens))
    t = token_bucket(sum(tokens), rows)
    assert sum(tokens) < t < rows * MAX_GRAPH_QUERY  # packed, with padding tokens
    assert shapes == [(rows, MAX_GRAPH_QUERY, t, max(wanted)), (rows, 1, rows, 3)]
