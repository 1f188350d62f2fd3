"""The drafts a step proposes, handed to its requests when the next step is scheduled.

A speculating step's drafting chain may still be on the device when the step is applied
(`engine.spec.speculation.NextDrafts` reads it on first look). `DraftsHandover` holds the
step's drafts and the requests they are for until the scheduler needs them, so the step's
tokens are applied and handed out first, and times the host's wait for them.
"""

from __future__ import annotations

import time

from engine.scheduler.output import StepDrafts
from engine.scheduler.request import Request, RequestStatus


class DraftsHandover:
    def __init__(self) -> None:
        self._held: tuple[StepDrafts, list[Request]] | None = None
        self._read_s = 0.0  # host time spent giving them out (waiting for the chain)

    def hold(self, drafts: StepDrafts, reqs: list[Request]) -> None:
        """Keep a step's drafts for ``reqs`` (the requests it applied that still run), in place
        of any held before (`give` them first)."""
        self._held = (drafts, reqs)

    def give(self) -> None:
        """Give each held request the drafts the step proposed for it (none where it proposed
        none), unless it has finished or been preempted since."""
        if self._held is None:
            return
        t0 = time.perf_counter()
        drafts, reqs = self._held
        self._held = None
        for req in reqs:
            d = drafts.get(req.request_id) if req.status == RequestStatus.RUNNING else None
            if d is not None:
                req.drafts, req.draft_conf = d
        self._read_s += time.perf_counter() - t0

    def take_read_s(self) -> float:
        """Seconds spent giving drafts out since the last call: the part of a drafting step's
        chain the host waited for after the step was applied (`EngineLoop` counts it in the
        step being scheduled, whose time it then is)."""
        t, self._read_s = self._read_s, 0.0
        return t
