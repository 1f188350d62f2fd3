"""`Request.token_ids_between`: the scheduler's slice of a request's known tokens."""

from __future__ import annotations

from engine.scheduler.request import Request


def test_token_ids_between_equals_slicing_every_known_token() -> None:
    req = Request("r", [1, 2, 3, 4, 5], max_tokens=10)
    req.output_token_ids.extend([6, 7, 8])
    every = req.all_token_ids
    for start in range(0, 10):
        for end in range(start, 11):
            assert req.token_ids_between(start, end) == every[start:end], (start, end)
