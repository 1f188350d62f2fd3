"""Driving an ``EngineCore`` step by step in tests (handoff tests on CPU and GPU)."""

from __future__ import annotations

import random
from dataclasses import replace

from engine.core import EngineCore
from engine.messages import CoreRequest, SeqOutput
from engine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids, the same for a seed."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def step_until(c: EngineCore, rid: str, n: int | None = None) -> tuple[list[int], str | None]:
    """Step ``c`` until ``rid`` finishes (its tokens and finish reason), or until it has at
    least ``n`` tokens (then the reason is None); at most 500 steps."""
    tokens: list[int] = []
    for _ in range(500):
        for o in c.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                if o.finish_reason is not None:
                    return tokens, o.finish_reason
        if n is not None and len(tokens) >= n:
            return tokens, None
    raise AssertionError(f"{rid} did not finish")


def run_greedy(
    c: EngineCore, rid: str, tokens: list[int], n: int, swa_replay: str | None = None
) -> tuple[list[int], SeqOutput]:
    """Add ``rid`` (greedy, ``n`` tokens, EOS ignored) and step ``c`` until it finishes, at
    most 1,000 steps: (its tokens, its last message)."""
    c.add(CoreRequest(rid, tuple(tokens), replace(GREEDY, max_tokens=n), swa_replay=swa_replay))
    out: list[int] = []
    for _ in range(1000):
        for o in c.step():
            if o.request_id == rid:
                out += o.new_token_ids
                if o.finish_reason is not None:
                    return out, o
    raise AssertionError(f"{rid} did not finish")
