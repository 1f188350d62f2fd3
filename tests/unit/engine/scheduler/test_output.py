"""`SchedulerOutput`'s counts of the tokens a step computes, by kind."""

from __future__ import annotations

from engine.scheduler.output import ScheduledSeq, SchedulerOutput


def _seq(rid: str, n: int, sample: bool = True, drafts: int = 0) -> ScheduledSeq:
    return ScheduledSeq(
        rid, tuple(range(3, 3 + n)), 10, (0,), 0, False, 0, 0, (0, 0), (), sample=sample, output_index=0,
        num_drafts=drafts,
    )  # fmt: skip


def test_prompt_tokens_are_those_of_rows_that_neither_decode_nor_verify() -> None:
    decode, verify = _seq("d", 1), _seq("v", 4, drafts=3)
    chunk, last_chunk = _seq("c", 256, sample=False), _seq("p", 40)
    assert SchedulerOutput(0, (decode, verify)).prompt_tokens == 0
    out = SchedulerOutput(1, (decode, verify, chunk, last_chunk))
    assert out.prompt_tokens == 256 + 40 and out.num_tokens == 1 + 4 + 256 + 40
    # a one-token prompt tail that samples is a decode row's shape, and counts as one
    assert SchedulerOutput(2, (_seq("t", 1),)).prompt_tokens == 0
