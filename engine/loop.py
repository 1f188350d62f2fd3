"""The engine step loop, sequential or asynchronous (pure Python, no torch).

Sequential: ``schedule -> execute -> update`` one step at a time.
Pipelined (sequential, with a `Launcher`): one thread keeps the next step queued on the
device: ``schedule N+1 -> launch N+1 -> finish N -> update N``. ``launch`` queues a step's
forward pass without waiting for the device, reading the previous step's greedy tokens on
the device, so the device runs step N+1 while the host samples step N, applies it and
builds step N+2. A step whose input needs the previous one's result on the host (sampled
tokens, verified drafts) finishes that one first; a step the executor will not hold
unfinished (store snapshots, drafts) is finished at once.
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
from typing import Any, Protocol

from engine.scheduler.output import RunnerOutput, SchedulerOutput
from engine.scheduler.scheduler import Scheduler, StepUpdate

ExecuteFn = Callable[[SchedulerOutput], RunnerOutput]


class Launcher(Protocol):
    """A step executed in two halves (`engine.executor.ModelExecutor`): ``launch`` queues the
    device work (``prev``: the step launched before, still unfinished, when ``follows``
    allows it), ``finish`` waits for it and returns the result; ``holds``: whether a launched
    step may stay unfinished while the next one launches."""

    def launch(self, out: SchedulerOutput, prev: Any = None) -> Any: ...

    def finish(self, launched: Any) -> RunnerOutput: ...

    def follows(self, out: SchedulerOutput, prev: Any) -> bool: ...

    def holds(self, launched: Any) -> bool: ...


@dataclass
class _Launched:
    out: SchedulerOutput
    handle: Any  # the launcher's; None once finished
    result: RunnerOutput | None = None
    error: BaseException | None = None
    seconds: float = 0.0  # host time spent launching and finishing it (and reading the drafts before it)


@dataclass(frozen=True)
class StepStat:
    """One executed step: tokens by kind and the execution time on the device thread."""

    prefill_tokens: int  # tokens of sequences computing more than one token
    decode_tokens: int  # one-token (decode) sequences
    seconds: float
    prompt_tokens: int = 0  # of prefill_tokens, those neither decoding nor verifying drafts


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
        launcher: Launcher | None = None,
        on_step: Callable[[SchedulerOutput, float], None] | None = None,
    ) -> None:
        """``launcher``: run the sequential loop pipelined (ignored with ``async_scheduling``).
        ``on_step(out, seconds)``: told of every executed step and its time, on the thread
        that executed it (the worker thread in asynchronous mode)."""
        self.scheduler = scheduler
        self._execute = execute
        self.async_scheduling = async_scheduling
        self._launcher = None if async_scheduling else launcher
        self._launched: deque[_Launched] = deque()
        self._overlap_after = overlap_after or (lambda _out: True)
        self.overlapped = 0  # steps submitted while another was in flight
        self.pipelined = 0  # steps launched while the one before was still on the device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sluice-exec") if async_scheduling else None
        self._inflight: deque[tuple[SchedulerOutput, Future[RunnerOutput]]] = deque()
        self.steps = 0
        self.stats: deque[StepStat] = deque(maxlen=4096)  # the latest steps, for benchmarks and metrics
        self.prompt_tokens = 0  # computed so far (StepStat.prompt_tokens summed over every step)
        self._on_step = on_step

    def _timed(self, out: SchedulerOutput, waited: float = 0.0) -> RunnerOutput:
        t0 = time.perf_counter()
        result = self._execute(out)
        self._record(out, time.perf_counter() - t0 + waited)
        return result

    def _record(self, out: SchedulerOutput, seconds: float) -> None:
        decode = sum(1 for s in out.seqs if s.num_new == 1)
        prompt = out.prompt_tokens
        self.stats.append(StepStat(out.num_tokens - decode, decode, seconds, prompt))
        self.prompt_tokens += prompt
        if self._on_step is not None:
            self._on_step(out, seconds)

    def _submit(self, out: SchedulerOutput, waited: float = 0.0) -> None:
        fut: Future[RunnerOutput]
        if self._pool is None:
            fut = Future()
            try:
                fut.set_result(self._timed(out, waited))
            except BaseException as exc:  # surfaced by result() below, like the async path
                fut.set_exception(exc)
        else:
            fut = self._pool.submit(self._timed, out, waited)
        self._inflight.append((out, fut))
        self.steps += 1

    def in_flight(self, request_id: str) -> bool:
        """Whether a step scheduled and not yet applied computes ``request_id``."""
        outs = [out for out, _ in self._inflight] + [e.out for e in self._launched]
        return any(request_id in (s.request_id, *s.fork_children) for out in outs for s in out.seqs)

    def has_work(self) -> bool:
        return bool(self._inflight) or bool(self._launched) or self.scheduler.has_unfinished()

    # -- pipelined ---------------------------------------------------------------------------
    def _finish(self, entry: _Launched) -> None:
        assert self._launcher is not None
        if entry.handle is None:
            return
        t0 = time.perf_counter()
        try:
            entry.result = self._launcher.finish(entry.handle)
        except BaseException as exc:  # raised when the step is applied, as on the other paths
            entry.error = exc
        entry.handle = None
        entry.seconds += time.perf_counter() - t0
        self._record(entry.out, entry.seconds)

    def _launch(self, out: SchedulerOutput, waited: float = 0.0) -> None:
        assert self._launcher is not None
        # the step launched before, while still unfinished
        prev = self._launched[-1] if self._launched and self._launched[-1].handle is not None else None
        if prev is not None and not self._launcher.follows(out, prev.handle):
            self._finish(prev)  # the new step reads prev's results on the host
            prev = None
        entry = _Launched(out, None)
        t0 = time.perf_counter()
        try:
            entry.handle = self._launcher.launch(out, None if prev is None else prev.handle)
        except BaseException as exc:
            entry.error = exc
        entry.seconds = time.perf_counter() - t0 + waited
        self._launched.append(entry)
        self.steps += 1
        self.pipelined += prev is not None
        if entry.handle is not None and not self._launcher.holds(entry.handle):
            if prev is not None:
                self._finish(prev)  # steps finish in launch order
            self._finish(entry)

    def _apply(self, entry: _Launched) -> StepUpdate:
        self._finish(entry)
        if entry.error is not None:
            raise entry.error
        assert entry.result is not None
        return self.scheduler.update(entry.out, entry.result)

    def step(self) -> StepUpdate:
        """Advance by one update: schedule (and submit or launch) the next step if there is
        one, then apply the oldest in-flight step's result. Returns what that update changed."""
        # asynchronous / pipelined: keep the next step queued behind the running one, so the
        # device starts it as soon as the running one ends while this thread applies results
        pipelined = self._launcher is not None
        queue: deque[Any] = self._launched if pipelined else self._inflight
        depth = 2 if pipelined or self.async_scheduling else 1
        while self.scheduler.has_unfinished() and len(queue) < depth:
            if queue and not self._overlap_after(self._out_of(queue[-1])):
                break  # the next step needs this one's result
            out = self.scheduler.schedule()
            # the last drafting chain's wait, which scheduling took: the device time between
            # steps is counted in the step after it (`DraftsHandover.take_read_s`)
            waited = self.scheduler.drafts.take_read_s()
            if out.is_empty:
                break
            self.overlapped += bool(queue)
            (self._launch if pipelined else self._submit)(out, waited)
        if not queue:
            if self.scheduler.has_ready():
                raise RuntimeError(
                    "the scheduler has unfinished requests but scheduled nothing: "
                    "the cache is too small for the head request"
                )
            return StepUpdate()
        if pipelined:
            return self._apply(self._launched.popleft())
        out, fut = self._inflight.popleft()
        return self.scheduler.update(out, fut.result())

    @staticmethod
    def _out_of(entry: Any) -> SchedulerOutput:
        return entry.out if isinstance(entry, _Launched) else entry[0]

    def drain(self) -> list[StepUpdate]:
        """Apply every step in flight without scheduling another: afterwards no request has
        a pending token and the executor is idle (export, idle snapshots)."""
        updates = []
        while self._launched:
            updates.append(self._apply(self._launched.popleft()))
        while self._inflight:
            out, fut = self._inflight.popleft()
            updates.append(self.scheduler.update(out, fut.result()))
        return updates

    @property
    def idle(self) -> bool:
        return not self._inflight and not self._launched

    def close(self) -> None:
        while self._launched:  # let the device work end before the caches go
            self._finish(self._launched.popleft())
        while self._inflight:
            _, fut = self._inflight.popleft()
            fut.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
