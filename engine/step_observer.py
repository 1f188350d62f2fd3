"""What the steps an engine executes tell its cost models (no torch).

Two listeners: the router's decode cost model (``costmodel.online``), which fits the decode
steps an engine serves (speculating ones included: `StepObserver.observe`), and a DSpark
speculation policy with measured costs, which times the steps it chose against its profile
(``SpecPolicy.observe_seconds``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from costmodel.online import DecodeStepSums
from engine.scheduler.output import SchedulerOutput
from engine.spec.costs import PLAIN, SPECULATING
from engine.spec.policy import SpecPolicy

if TYPE_CHECKING:
    from engine.runner import ModelRunner


class StepObserver:
    """Notes each executed step for the decode cost model and the speculation policy's step
    timing. ``observe`` is the loop's ``on_step`` and runs on the executing thread; ``start``,
    ``finish`` and the stats run on the driving one, which sums what ``observe`` noted."""

    def __init__(self, runner: ModelRunner, spec: SpecPolicy | None, overlaps_steps: bool) -> None:
        self.runner = runner
        self.spec = spec
        # the decode steps this engine runs, for the router's decode cost model
        # (costmodel.online): noted on the executing thread, summed on the driving one
        self.decode_steps = DecodeStepSums()
        self.decode_steps_extra = self.decode_steps.to_extra()  # replaced whole: read by stats()
        self._new_decode_steps: deque[tuple[int, int, float]] = deque(maxlen=4096)
        self._graph_captures = 0
        # a DSpark policy times the steps it chose against its profile (SpecPolicy.observe_seconds):
        # whole steps, as the profile times them, so not where steps overlap (asynchronous)
        self.times_spec_steps = (
            spec is not None and spec.adaptive and spec.config.measured_costs and not overlaps_steps
        )
        self._step_clean = True  # no executed step of this call ran anything but decoding
        self._t0 = 0.0

    def start(self) -> None:
        """An ``EngineCore.step`` that executes a step begins."""
        self._t0 = time.perf_counter()
        self._step_clean = True

    def finish(self) -> None:
        """It ends: the policy is told its wall time, and the decode steps noted are summed."""
        if self.times_spec_steps:
            assert self.spec is not None
            self.spec.observe_seconds(time.perf_counter() - self._t0, self._step_clean)
        self._sum_decode_steps()

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Note ``out`` if it is a decode step: every sequence computes the token it sampled
        last (and, speculating, the drafts it verifies) and samples the next, and nothing
        but the forward pass, sampling and drafting ran in it (no cache loads, slot saves or
        fork copies, no CUDA graph captured). Its batch (sequences, not tokens), the KV
        tokens it read (those in the caches before it, as the profiled step tables count
        them) and its seconds are what the decode cost model fits.

        A speculating engine's steps count whole, its verified drafts and drafting passes
        included: the router places sequences, so a sequence's share of a step (``d1``) is
        what the 2D balancer weighs, and on a speculating engine that share holds the drafts
        it verifies. Its steps then fit that engine's own costs, which a plain-decode step
        table priced low; an engine that turns speculation off on some steps (DSpark) adds
        both kinds, in the mix its policy chose at each load."""
        graphs = self.runner.graphs
        captures = graphs.captures if graphs is not None else 0
        captured, self._graph_captures = captures != self._graph_captures, captures
        moved = bool(out.kv_loads or out.slot_loads or out.slot_saves or out.block_copies or out.slot_copies)
        decoding = bool(out.seqs) and out.prompt_tokens == 0  # every row decodes or verifies
        # what the speculation policy's step timing may count (a pipelined step finishes in
        # the next call, so its verdict lands there; the steps either side of it are mostly
        # of its kind, and the policy takes a median over many)
        self._step_clean = self._step_clean and decoding and not captured and not moved
        if captured or not out.seqs or moved:
            return
        if any(s.num_new != 1 + s.num_drafts or not s.sample for s in out.seqs):
            return
        self._new_decode_steps.append((len(out.seqs), sum(s.start_pos for s in out.seqs), seconds))

    def _sum_decode_steps(self) -> None:
        if self._new_decode_steps:
            while self._new_decode_steps:
                self.decode_steps.add(*self._new_decode_steps.popleft())
            self.decode_steps_extra = self.decode_steps.to_extra()

    def spec_cost_stats(self) -> dict[str, float]:
        """Measured / profiled step times, per kind, and the host time of the policy's choice
        in a step with drafts (``SpecPolicy.costs``); empty unless the policy's steps are
        timed."""
        if not self.times_spec_steps:
            return {}
        assert self.spec is not None
        costs = self.spec.costs
        return dict(
            spec_cost_scale_plain=costs.scale(PLAIN), spec_cost_scale_speculating=costs.scale(SPECULATING),
            spec_cost_steps_plain=float(costs.steps[PLAIN]),
            spec_cost_steps_speculating=float(costs.steps[SPECULATING]),
            spec_cost_host_seconds=costs.host,
        )  # fmt: skip
