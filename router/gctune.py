"""Garbage-collector settings for a process that makes latency-bound routing decisions.

CPython's cyclic collector runs a young-generation pass every ``gen0`` container
allocations (700 by default). A routing decision allocates a few dozen small lists and
tuples, so with the default one decision in a few dozen pays for a collection that scans
every young object, and now and then an older generation with the whole prefix index in
it: that is most of the decision-latency tail (``sluice bench router --micro`` reports
both settings). The remedy is the usual one for latency-sensitive Python servers: move
what exists after start-up out of the collector's view (``gc.freeze``) and collect the
young generation less often. Memory held by garbage cycles grows by at most ``gen0``
objects between collections; reference counting still frees everything else at once.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass


@dataclass(frozen=True)
class GcSettings:
    gen0: int = 50_000
    gen1: int = 20
    gen2: int = 100

    def __post_init__(self) -> None:
        if min(self.gen0, self.gen1, self.gen2) < 1:
            raise ValueError(f"GC thresholds must be >= 1, got {self.gen0}/{self.gen1}/{self.gen2}")


def tune_for_latency(settings: GcSettings = GcSettings()) -> tuple[int, int, int]:
    """Freeze the objects alive now and raise the thresholds; returns the previous thresholds.

    Call once the long-lived state is built (after start-up, or after building an index).
    """
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(settings.gen0, settings.gen1, settings.gen2)
    return previous


def restore(previous: tuple[int, int, int]) -> None:
    """Undo ``tune_for_latency``: the old thresholds, frozen objects back under collection."""
    gc.set_threshold(*previous)
    gc.unfreeze()
