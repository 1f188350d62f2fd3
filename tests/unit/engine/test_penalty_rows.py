"""`PenaltyRows`: penalised requests' histories kept on the device, one row each, updated on
the device with each sampled token. A row must always equal the history built from the
request's token ids (`sampler._histories`), whether its tokens were recorded on the device or
appended on the host (verified drafts), after a rollback, and after its row is reused."""

from __future__ import annotations

import torch

from engine.sampling.params import SamplingParams
from engine.sampling.penalties import PenaltyRows
from engine.sampling.sampler import RowInput, _histories

V = 50
PEN = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3)


def _row(prompt, outs) -> RowInput:
    return RowInput(PEN, 1, len(outs), list(prompt), list(outs))


def _check(book: PenaltyRows, keys, rows) -> None:
    seen, counts = book.gather(keys, rows)
    want_seen, want_counts = _histories(rows, V, torch.device("cpu"))
    for i, key in enumerate(keys):
        if key is None:
            assert not seen[i].any() and not counts[i].any()
        else:
            assert torch.equal(seen[i], want_seen[i]) and torch.equal(counts[i], want_counts[i]), key


def test_rows_follow_recorded_and_host_appended_tokens() -> None:
    torch.manual_seed(0)
    book = PenaltyRows(V, "cpu")
    prompts = {f"r{i}": torch.randint(0, V + 5, (7 + i,)).tolist() for i in range(5)}  # some ids past V
    outs: dict[str, list[int]] = {k: [] for k in prompts}
    for step in range(12):
        keys = [k for i, k in enumerate(prompts) if (i + step) % 4]  # rows come and go between steps
        rows = [_row(prompts[k], outs[k]) for k in keys]
        _check(book, [*keys, None], [*rows, _row([], [])])
        tokens = torch.randint(0, V, (len(keys),))
        book.gather(keys, rows)
        book.record(keys, tokens)
        for k, t in zip(keys, tokens.tolist()):
            outs[k].append(t)
        if step % 5 == 2:  # tokens sampled on the host (verified drafts): the row catches up
            outs["r1"] += [3, 3, 7]
    assert len(book) == len(prompts)
    _check(book, list(prompts), [_row(prompts[k], outs[k]) for k in prompts])


def test_a_rolled_back_or_reused_row_is_rebuilt() -> None:
    book = PenaltyRows(V, "cpu")
    book.gather(["a"], [_row([1, 2], [4, 4, 5])])
    _check(book, ["a"], [_row([1, 2], [4])])  # fewer outputs than the row holds: rebuilt
    book.drop("a")
    book.gather(["b"], [_row([9], [])])  # takes a's row: zeroed first
    _check(book, ["b"], [_row([9], [])])
    for i in range(9):  # grows past its capacity, row 0 staying the zero row
        book.gather([f"c{i}"], [_row([i], [i + 1])])
    _check(book, [None, "b", "c8"], [_row([], []), _row([9], []), _row([8], [9])])
