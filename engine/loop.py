"""The engine step loop, sequential or asynchronous (pure Python, no torch).

Sequential: ``schedule -> execute -> update`` one step at a time.
Asynchronous: step N+1 is scheduled on the CPU while step N executes on a worker thread
(the device queue); ``update(N)`` is applied after N+1 has been submitted. The scheduler
advances its state optimistically, so both modes issue the same sequence computations
and produce the same tokens; asynchronous mode may run one extra decode step for a
request that has just stopped, whose result is discarded. With one worker and steps
submitted in order, the device executes steps in schedule order, which is what makes
freeing blocks at schedule time safe.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.scheduler.output import RunnerOutput, SchedulerOutput
from engine.scheduler.scheduler import Scheduler, StepUpdate

ExecuteFn = Callable[[SchedulerOutput], RunnerOutput]


@dataclass(frozen=True)
class StepStat:
    """One executed step: tokens by kind and the execution time on the device thread."""

    prefill_tokens: int  # tokens of sequences computing more than one token
    decode_tokens: int  # one-token (decode) sequences
    seconds: float


class EngineLoop:
    """``overlap_after(out)``: whether the step after ``out`` may be scheduled before ``out``'s
    result is in (asynchronous mode). A speculating engine's steps need the previous step's
    drafts and verified tokens, except when it neither drafted nor verified (speculation
    off): then it overlaps as plain decoding does. Default: always."""

    def __init__(
        self,
        scheduler: Scheduler,
        execute: ExecuteFn,
        async_scheduling: bool = False,
        overlap_after: Callable[[SchedulerOutput], bool] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._execute = execute
        self.async_scheduling = async_scheduling
        self._overlap_after = overlap_after or (lambda _out: True)
        self.overlapped = 0  # steps submitted while another was in flight
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-exec") if async_scheduling else None
        self._inflight: deque[tuple[SchedulerOutput, Future[RunnerOutput]]] = deque()
        self.steps = 0
        self.stats: deque[StepStat] = deque(maxlen=4096)  # the latest steps, for benchmarks and metrics

    def _timed(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result = self._execute(out)
        decode = sum(1 for s in out.seqs if s.num_new == 1)
        self.stats.append(StepStat(out.num_tokens - decode, decode, time.perf_counter() - t0))
        return result

    def _submit(self, out: SchedulerOutput) -> None:
        fut: Future[RunnerOutput]
        if self._pool is None:
            fut = Future()
            try:
                fut.set_result(self._timed(out))
            except BaseException as exc:  # surfaced by result() below, like the async path
                fut.set_exception(exc)
        else:
            fut = self._pool.submit(self._timed, out)
        self._inflight.append((out, fut))
        self.steps += 1

    def has_work(self) -> bool:
        return bool(self._inflight) or self.scheduler.has_unfinished()

    def step(self) -> StepUpdate:
        """Advance by one update: schedule (and submit) the next step if there is one, then
        apply the oldest in-flight step's result. Returns what that update changed."""
        # asynchronous: keep the next step queued behind the running one, so the worker starts
        # it as soon as the running one returns while this thread applies results
        depth = 2 if self.async_scheduling else 1
        while self.scheduler.has_unfinished() and len(self._inflight) < depth:
            if self._inflight and not self._overlap_after(self._inflight[-1][0]):
                break  # the next step needs this one's result
            out = self.scheduler.schedule()
            if out.is_empty:
                break
            self.overlapped += bool(self._inflight)
            self._submit(out)
        if not self._inflight:
            if self.scheduler.has_ready():
                raise RuntimeError(
                    "the scheduler has unfinished requests but scheduled nothing: "
                    "the cache is too small for the head request"
                )
            return StepUpdate()
        out, fut = self._inflight.popleft()
        return self.scheduler.update(out, fut.result())

    def drain(self) -> list[StepUpdate]:
        """Apply every step in flight without scheduling another: afterwards no request has
        a pending token and the executor is idle (export, idle snapshots)."""
        updates = []
        while self._inflight:
            out, fut = self._inflight.popleft()
            updates.append(self.scheduler.update(out, fut.result()))
        return updates

    @property
    def idle(self) -> bool:
        return not self._inflight

    def close(self) -> None:
        while self._inflight:
            _, fut = self._inflight.popleft()
            fut.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
