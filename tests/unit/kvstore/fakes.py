"""Fakes shared by the kvstore unit tests."""

from __future__ import annotations


class Clock:
    """A clock the test moves by hand: ``clock.t += 5`` (seconds)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t
