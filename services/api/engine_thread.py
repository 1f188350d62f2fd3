"""``EngineThread``: the engine core (``engine/core.py``) on the background thread of
``services.api.inprocess.InProcessEngineClient``, which is its asyncio side.

One thread owns the ``EngineCore`` and is the only code that steps it or changes its
requests. The event loop talks to it through a FIFO command queue (add, import, abort,
reserve, release, room, probe); the thread answers through ``loop.call_soon_threadsafe`` into
one ``asyncio.Queue`` per request (a command's future for the others). Commands are applied
between steps, in order, so an abort queued after an add always finds the request. Counters
are published as an immutable snapshot after every step, so reading ``stats`` never touches
engine state across threads.

Disaggregated serving: a prefill for another engine is exported (``EngineCore.export_sequence``,
taken between steps right after the step that sampled the first token) and its stream ends
with a ``Handoff``, after which nothing of the request is running here. An import takes the
sequence's reservation (``Reservations``, kept by the reserve / release / room commands) or
must leave the room promised to others.

With ``cache_event_capacity > 0`` the engine records prefix-cache events; after every step
the engine thread moves them (``EngineCore.drain_events``) into a bounded outbox
(``CacheEventOutbox``, under a lock held for microseconds) that ``take_cache_events`` drains.
Each change of the stats or the cache events is announced (``Announcements``), so a watcher
sleeps while the engine is idle.

The thread of an expert-parallel rank steps in lockstep with its group's other ranks
(``engine.distributed.lockstep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from services.api.announce import Announcements
from services.api.engine_client import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
)
from services.api.handoff import Handoff, Reservations

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
# An idle EP rank waits between agreements, 10 ms at first, doubling while the whole group
# stays idle up to 50 ms: a request arriving at a group idle for a while waits at most 50 ms
# (plus one collective) for its group to start stepping. Each agreement costs every rank a
# collective and a housekeeping pass (docs/disaggregation.md, "Expert-parallel instances").
_EP_IDLE_WAIT_S = 0.01
_EP_IDLE_WAIT_MAX_S = 0.05


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request."""

    request: EngineRequest
    sink: asyncio.Queue[EngineOutput | Handoff | BaseException]
    handoff: bool = False  # prefill for another engine: export after the first token


@dataclass
class _Counters:
    requests_total: int = 0
    aborted_total: int = 0
    finished_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class EngineThread:
    """The thread stepping ``core``, and what it shares with the event loop: the command
    queue (``send``), the published ``stats`` and cache events, ``dead``.

    The caller sets ``core`` (and for an EP rank ``lockstep``), ``outbox`` and ``vision``
    before ``start``; ``bind`` comes first of all."""

    def __init__(self) -> None:
        self.core: Any = None  # engine.core.EngineCore, owned by the engine thread
        self.lockstep: Any = None  # engine.distributed.lockstep.Lockstep of an EP rank
        self.outbox: Any = None  # CacheEventOutbox when the engine records cache events
        self.vision: Any = None  # engine.vision.stage.VisionStage: its counters join the stats
        self.reservations = Reservations()  # engine thread only
        self.announced = Announcements()  # each change of the stats or cache events
        self.dead: BaseException | None = None  # why the thread ended (EngineUnavailable: it stopped)
        self.stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0)  # the last snapshot published (replaced whole)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counters = _Counters()
        self._events_lock = threading.Lock()
        self._stats_version = 0

    # -- event loop side -------------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer and announce to ``loop`` (call on it, before anything else)."""
        self._loop = loop
        self.announced.bind(loop)

    @property
    def started(self) -> bool:
        """``start`` ran and ``close`` has not."""
        return self._thread is not None

    def start(self) -> None:
        """Publish the first stats and start stepping ``core``."""
        self._publish_stats()
        run = self._run if self.lockstep is None else self._run_lockstep
        self._thread = threading.Thread(target=run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the thread (waiting up to 30 s for it), then close the engine and leave its EP group."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
        if self.core is not None:
            self.core.close()
            self.core = None
        if self.lockstep is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.lockstep = None

    def send(self, kind: str, payload: Any) -> None:
        """Queue a command for the thread (from any thread): applied between steps, in order."""
        self._commands.put((kind, payload))
        self._wake.set()

    def take_cache_events(self) -> Any:
        """The outbox's events since the last call (``CacheEventBatch``); never blocks on the engine."""
        from engine.scheduler.cache_events import CacheEventBatch

        if self.outbox is None:
            return CacheEventBatch()
        with self._events_lock:
            return self.outbox.take()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        live: dict[str, _Live] = {}
        try:
            while not self._stop.is_set():
                self._drain(live)
                if not self.core.has_work():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    # The KV store connector's counters move on its writer thread after the
                    # last step (the write-through of that step's blocks): republish them.
                    self._publish_stats()
                    continue
                self._apply(self.core.step(), live)
                self._publish_stats()
                self._publish_cache_events()
            self._stopped(live, None)
        except BaseException as exc:  # the engine died: fail everything, refuse what follows
            self._stopped(live, exc)

    def _run_lockstep(self) -> None:
        """The engine thread of an EP rank (``engine.distributed.lockstep``): every iteration
        the ranks agree whether any has a forward to run, then all run one (real or idle)."""
        live: dict[str, _Live] = {}
        ls = self.lockstep
        assert ls is not None
        try:
            idle_wait = _EP_IDLE_WAIT_S
            while True:
                self._drain(live)
                any_ready, any_stop = ls.agree(self.core.will_forward(), self._stop.is_set())
                if any_stop:
                    break
                if any_ready:
                    idle_wait = _EP_IDLE_WAIT_S
                    self._apply(ls.step(), live)
                    self._publish_stats()
                    self._publish_cache_events()
                    continue
                self._apply(self.core.housekeeping(), live)
                woken = self._wake.wait(idle_wait)  # by a command for this rank
                self._wake.clear()
                idle_wait = _EP_IDLE_WAIT_S if woken else min(2 * idle_wait, _EP_IDLE_WAIT_MAX_S)
                self._publish_stats()
            self._stopped(live, None)
        except BaseException as exc:  # a peer died (collective timeout) or the engine failed
            self._stopped(live, exc)

    def _stopped(self, live: dict[str, _Live], exc: BaseException | None) -> None:
        if exc is None:
            err = EngineUnavailable("engine stopped")
            self.dead = err
        else:
            log.error("engine thread died", exc_info=exc)
            self.dead = exc
            err = EngineUnavailable(f"engine failed: {exc!r}")
        for item in live.values():  # in-flight requests end now, not at their timeout
            self._deliver(item.sink, err)
        self._fail_pending(err)

    def _drain(self, live: dict[str, _Live]) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(live, *payload)
            elif kind == "import":
                self._import(live, *payload)
            elif kind in ("reserve", "release", "room"):
                args, fut = payload
                try:
                    if kind == "reserve":
                        answer: Any = self.reservations.reserve(self.core, *args)
                    elif kind == "release":
                        answer = self.reservations.release(args)
                    else:
                        answer = self.reservations.room(self.core)
                except ValueError as exc:
                    answer = EngineRequestError(str(exc))
                self._publish_stats()  # before the answer: a caller reading stats sees the change
                self._resolve(fut, answer)
            elif kind == "abort":
                self.reservations.release(payload)
                # Scheduler side only: a step already in flight on the executor thread may still
                # read this request's sampling state; the executor drops it itself when the
                # next step lists the request among ``finished_ids``.
                if self.core.abort(payload):
                    self._counters.aborted_total += 1
                live.pop(payload, None)
                self._publish_stats()
                self._publish_cache_events()  # freeing registers its computed full blocks
            elif kind == "probe":
                self._resolve(payload, True)

    def _add(
        self,
        live: dict[str, _Live],
        request: EngineRequest,
        core_req: Any,
        grammar: Any,
        sink: Any,
        added: Any,
        mode: str | None,
    ) -> None:
        try:
            self.core.add(core_req, grammar)
        except ValueError as exc:
            self._resolve(added, EngineRequestError(str(exc)))
            return
        live[request.request_id] = _Live(request, sink, handoff=mode == "handoff")
        self._counters.requests_total += 1
        self._resolve(added, None)

    def _import(
        self, live: dict[str, _Live], request: EngineRequest, _core_req: Any, _grammar: Any, sink: Any, added: Any,
        payload: bytes,
    ) -> None:  # fmt: skip
        from engine.kvconnector.transfer import EngineFull

        core, rid = self.core, request.request_id
        try:
            got = core.import_sequence(payload)
        except EngineFull as exc:
            self._resolve(added, exc)
            return
        except (ValueError, KeyError) as exc:  # PayloadError is a ValueError
            self._resolve(added, EngineRequestError(f"handoff of {rid!r} refused: {exc}"))
            return
        problem: BaseException | None = None
        if got != rid:  # the payload names its own request: a mix-up is a bug upstream
            problem = EngineRequestError(f"handoff payload is for {got!r}, not {rid!r}")
        elif self.reservations.held.pop(rid, None) is None and self.reservations.over(core):
            problem = EngineFull(
                f"no room for sequence {rid!r} beside {len(self.reservations.held)} reservations: "
                "reserve first, or pick another engine"
            )
        if problem is not None:
            core.abort(got)
            core.take_outputs()
            self._resolve(added, problem)
            return
        live[rid] = _Live(request, sink)
        self._counters.requests_total += 1
        self._count("handoffs_in", 1)
        self._count("handoff_bytes_in", len(payload))
        self._resolve(added, None)

    def _eplb_stats(self) -> dict[str, float]:
        """EP and EPLB counters of a rank: forwards (idle ones apart), the empty MTP passes
        that matched the group's drafting (speculating ranks), layers re-placed, and the last
        window's load imbalance (max/mean over ranks, mean over layers) under the placement
        that served it and under the one planned from it."""
        ls = self.lockstep
        if ls is None:
            return {}
        out = {"ep_forwards": float(ls.forwards), "ep_idle_passes": float(ls.idle_passes)}
        drafts = ls.core.executor.speculation.lockstep
        if drafts is not None:
            out["ep_empty_mtp_passes"] = float(drafts.padded)
        if ls.eplb is not None:
            out["eplb_layers_moved"] = float(ls.eplb.runner.layers_moved)
            last = ls.eplb.runner.controller.last_imbalance
            if last is not None:
                out["eplb_imbalance"], out["eplb_imbalance_planned"] = last
        return out

    def _count(self, name: str, n: float) -> None:
        self._counters.extra[name] = self._counters.extra.get(name, 0.0) + n

    def _apply(self, outputs: list[Any], live: dict[str, _Live]) -> None:
        exports = []
        for out in outputs:  # engine.core.SeqOutput
            item = live.get(out.request_id)
            if item is None:
                continue
            if item.handoff and out.finish_reason is None and out.new_token_ids:
                exports.append(out.request_id)
            reason = out.finish_reason
            if reason is not None:
                live.pop(out.request_id, None)
                self._counters.finished_total += 1
            if reason == "error":  # this request's own input failed mid-run: a 4xx, not an outage
                self._deliver(item.sink, EngineRequestError(out.error or "request failed"))
                continue
            new = out.new_token_ids
            if out.stop_token is not None and new and new[-1] == out.stop_token:
                new = new[:-1]  # the terminating EOS/stop token is counted, not sent as text
            lps = None
            if item.request.top_logprobs is not None and len(out.new_token_ids) == 1 and out.new_logprobs[0]:
                tl = out.new_logprobs[0]
                lps = ((float(tl.logprob), [(int(t), float(lp)) for t, lp in tl.top]),)
            self._deliver(
                item.sink,
                EngineOutput(
                    out.request_id, tuple(new), lps, reason, out.prompt_tokens, out.cached_tokens,
                    out.output_tokens, out.bounded_replay,
                ),
            )  # fmt: skip
        for rid in dict.fromkeys(exports):
            self._export(rid, live)

    def _export(self, rid: str, live: dict[str, _Live]) -> None:
        """Hand ``rid`` over after the step that sampled its first token. Steps in flight are
        applied first (``export_sequence`` drains them): their outputs, this request's too,
        are delivered before the ``Handoff``; a request that ended in them ends here."""
        item = live.get(rid)
        if item is None:
            return
        item.handoff = False  # the late outputs below are delivered, not exported again
        try:
            payload: bytes | None = self.core.export_sequence(rid)
            problem = None
        except (KeyError, ValueError) as exc:
            payload, problem = None, exc
        self._apply(self.core.take_outputs(), live)
        if rid not in live:  # it finished in a step that was in flight
            return
        live.pop(rid)
        if payload is None:
            self.core.abort(rid)
            self.core.take_outputs()
            self._deliver(item.sink, EngineUnavailable(f"handoff of {rid!r} failed: {problem!r}"))
            return
        self._count("handoffs_out", 1)
        self._count("handoff_bytes_out", len(payload))
        self._deliver(item.sink, Handoff(rid, payload))

    def _deliver(self, sink: asyncio.Queue[Any], item: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(sink.put_nowait, item)

    def _resolve(self, fut: asyncio.Future[Any], value: Any) -> None:
        def settle() -> None:
            if fut.done():
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(settle)

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind in ("add", "import"):
                self._resolve(payload[4], err)
            elif kind in ("reserve", "release", "room"):
                self._resolve(payload[1], err)
            elif kind == "probe":
                self._resolve(payload, False)

    def _publish_cache_events(self) -> None:
        if self.outbox is None:
            return
        batch = self.core.drain_events()
        if batch:
            with self._events_lock:
                self.outbox.publish(batch, self.core.cached_hashes)
            self.announced.announce()

    def _publish_stats(self) -> None:
        """Replace the published stats if they changed. ``stats_version`` counts the changes,
        so an idle engine's snapshot stays the same object: whoever pushes it on when it
        changes (``services.ray.actors``' ``watch``) sends nothing while nothing happens."""
        st = self.core.stats()
        c = self._counters
        fresh = EngineStats(
            running=st.running,
            waiting=st.waiting,
            free_blocks=st.free_blocks,
            total_blocks=st.total_blocks,
            requests_total=c.requests_total,
            aborted_total=c.aborted_total,
            finished_total=c.finished_total,
            steps=st.steps,
            extra={
                **st.extra,
                **c.extra,
                "kv_tokens": float(st.kv_tokens),
                "reserved": float(len(self.reservations.held)),
                "reserved_tokens": float(sum(t for _, t in self.reservations.held.values())),
                "reservations_refused": float(self.reservations.refused),
                "stats_version": float(self._stats_version),  # orders snapshots read elsewhere
                **self._eplb_stats(),
                **(self.vision.stats() if self.vision is not None else {}),
            },
        )
        if fresh == self.stats:
            return
        self._stats_version += 1
        fresh.extra["stats_version"] = float(self._stats_version)
        self.stats = fresh
        self.announced.announce()
