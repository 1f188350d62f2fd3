"""``InProcessEngineClient``: the engine core (``engine/core.py``) on a background thread, bridged to asyncio.

One thread owns the ``EngineCore`` and is the only code that calls it. The event loop talks to it through a FIFO command queue (add, abort, probe);
the thread answers through ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per
request. Commands are applied between steps, in order, so an abort queued after an add
always finds the request. Counters are published as an immutable snapshot after every
step, so ``stats()`` never reads engine state across threads.

Grammar compilation (which may take up to the compiler's time limit) runs on the caller's
worker thread, not the engine thread: a slow schema delays only its own request.

Disaggregated serving uses three more calls (the Ray engine actors wrap this class):
``prefill(request)`` streams the first output(s) and then a ``Handoff`` with the sequence's
payload (``EngineCore.export_sequence``, taken between steps right after the step that
sampled the first token), after which nothing of the request is running here;
``resume(request, payload)`` imports such a payload and streams the rest as ``generate``
does; ``reserve`` / ``release`` promise room to a sequence before its payload arrives
(``Reservations``), so a decode engine takes it or refuses up front.

With ``cache_event_capacity > 0`` the engine records prefix-cache events; after every step
the engine thread moves them (``EngineCore.drain_events``) into a bounded outbox (``CacheEventOutbox``, under a lock held
for microseconds) that a router drains with ``take_cache_events``. ``changed(seen, timeout_s)``
returns once either moved on (new stats or cache events), so a watcher that pushes them on
sleeps while the engine is idle instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.api.announce import Announcements
from services.api.engine_client import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
    ModelInfo,
)
from services.api.handoff import Handoff, Reservations

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05
# An abort is remembered this long (and at most this many), so that a call whose abort raced
# its start does not start the request afterwards (``aborted_since``).
ABORT_MEMORY_S = 600.0
ABORT_MEMORY = 65_536
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


class InProcessEngineClient:
    """Serve ``model_dir`` with ``EngineCore(EngineConfig(model_dir, **engine_kwargs))`` in this process."""

    def __init__(
        self,
        model_dir: str | Path,
        ep: Any = None,
        eplb: Any = None,
        ep_store: Any = None,
        encode_images: bool = True,
        ep_interface: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``ep``: an ``engine.distributed.lockstep.EPMember`` (or its fields as a dict) when
        this engine is one rank of an expert-parallel group; it then steps in lockstep with
        the group's other ranks. ``eplb``: ``services.eplb.controller.EplbConfig`` (or its
        fields) to balance the group's experts while it serves (EP only). ``ep_store``: a
        function returning the group's rendezvous store, called when the rank joins
        (default: the file ``ep`` names). ``ep_interface``: the network interface of the
        group's gloo sockets on CPU (the one holding the address the cluster knows this host
        by; default loopback: every rank on this host). ``encode_images=False``: a vision pool encodes this
        engine's images, so it loads no encoder of its own; it takes rows the pool made
        (``EncodedImage``, verified against the checkpoint's encoder) and refuses raw images."""
        from engine.distributed.lockstep import EPMember

        self.model_dir = Path(model_dir)
        self.encode_images = encode_images
        self.engine_kwargs = dict(engine_kwargs)
        self.ep: EPMember | None = EPMember(**ep) if isinstance(ep, dict) else ep
        if eplb is not None and self.ep is None:
            raise ValueError("EPLB balances an expert-parallel group: give ep too")
        if isinstance(eplb, dict):
            from services.eplb.controller import EplbConfig

            eplb = EplbConfig(**eplb)
        self.eplb = eplb if eplb is not None and eplb.enabled else None
        self._lockstep: Any = None
        self.ep_store = ep_store  # () -> torch.distributed.Store: the group's rendezvous (default: ep's file)
        self.ep_interface = ep_interface or "lo"
        self._info = _read_model_info(self.model_dir, self.engine_kwargs)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        # request ids aborted lately (their time): a request whose abort arrived before it was
        # sent to the engine (it raced its own start, e.g. during a handoff's fetch) never starts
        self._aborted: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: Any = None  # engine.core.EngineCore, owned by the engine thread
        self._vision: Any = None  # engine.vision.stage.VisionStage when the checkpoint has an encoder
        self._rows_format: Any = None  # engine.vision.stage.RowsFormat: rows encoded elsewhere
        self._dead: BaseException | None = None
        self._counters = _Counters()
        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0)
        self._events_lock = threading.Lock()
        self._outbox: Any = None  # CacheEventOutbox when the engine records cache events
        self.reservations = Reservations()  # engine thread only
        self._stats_version = 0
        self._announced = Announcements()  # each change of the stats or cache events

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        from engine.core import EngineConfig, EngineCore

        self._loop = asyncio.get_running_loop()
        self._announced.bind(self._loop)
        if self.ep is None:
            config = EngineConfig(model=str(self.model_dir), **self.engine_kwargs)
            self._core = await asyncio.to_thread(EngineCore, config)
        else:
            config = EngineConfig(
                model=str(self.model_dir), **{**self.engine_kwargs, "async_scheduling": False},
                ep_size=self.ep.size, ep_rank=self.ep.rank,
            )  # fmt: skip
            self._core = await asyncio.to_thread(self._join_group, config)
        if self._info.vision:
            from engine.vision.stage import RowsFormat, VisionStage

            dtype = self._core.runner.cfg.torch_dtype
            if self.encode_images:
                self._vision = await asyncio.to_thread(
                    VisionStage.from_model_dir, self.model_dir, config.device, dtype
                )
            # rows a vision pool made must come from this checkpoint's encoder
            self._rows_format = await asyncio.to_thread(RowsFormat.from_model_dir, self.model_dir, dtype)
        sharing = self._core.slot_sharing
        if sharing is not None:  # the replica's slot server, for a router reading the directory
            pool = sharing.pool
            self._info = replace(
                self._info, swa_holder=sharing.holder, swa_directory=config.swa_directory,
                swa_slot_exact=not pool.lossy,
                swa_slot_replay=self._info.swa_replay_tokens[1] if pool.layers is not None else 0,
            )  # fmt: skip
        if config.cache_event_capacity and self._core.records_events():
            from engine.scheduler.cache_events import CacheEventOutbox

            self._outbox = CacheEventOutbox(config.cache_event_capacity)
        self._publish_stats()
        run = self._run if self._lockstep is None else self._run_lockstep
        self._thread = threading.Thread(target=run, name="sluice-engine", daemon=True)
        self._thread.start()

    def _join_group(self, config: Any) -> Any:
        """Join this rank's EP group, then build its engine on the group (a worker thread)."""
        from engine.core import EngineCore
        from engine.distributed.lockstep import Lockstep

        assert self.ep is not None
        from services import envs

        if not config.device.startswith("cuda") and envs.foreign("GLOO_SOCKET_IFNAME") is None:
            envs.export_to_children({"GLOO_SOCKET_IFNAME": self.ep_interface})  # an operator's own wins
        group = self.ep.join(config.device, self.ep_store() if self.ep_store is not None else None)
        if self.eplb is None:
            core = EngineCore(config, ep_group=group)
            self._lockstep = Lockstep(core, group)
            return core
        from engine.config import ModelConfig
        from services.eplb.engine import EngineEplb, initial_placement

        experts = ModelConfig.from_dir(config.model).n_routed_experts
        placement = initial_placement(self.eplb, experts, self.ep.size, self.ep.rank)
        core = EngineCore(config, ep_group=group, placement=placement)
        eplb = EngineEplb(self.eplb, core.runner.model.moe_layers(), self.ep.rank, group)
        self._lockstep = Lockstep(core, group, eplb)
        return core

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
        if self._core is not None:
            self._core.close()
            self._core = None
        if self._lockstep is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._lockstep = None

    # -- EngineClient ----------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        """Started and its engine thread has not stopped or died (cheap; no round trip)."""
        return self._thread is not None and self._dead is None

    @property
    def failed(self) -> BaseException | None:
        """Why the engine thread died, if it did (not for a clean ``close``)."""
        return None if isinstance(self._dead, EngineUnavailable) else self._dead

    def cache_identity(self) -> tuple[int, Any]:
        """(block size, ``ExtraKeys``): how this engine names cached blocks. After ``start``."""
        if self._core is None:
            raise EngineUnavailable("engine is not started")
        return self._core.block_size, self._core.extra_keys

    def take_cache_events(self) -> Any:
        """Prefix-cache events since the last call, as a ``CacheEventBatch`` (empty when the
        engine records none). Safe from the event loop; never blocks on the engine."""
        from engine.scheduler.cache_events import CacheEventBatch

        if self._outbox is None:
            return CacheEventBatch()
        with self._events_lock:
            return self._outbox.take()

    async def changed(self, seen: int, timeout_s: float) -> int:
        """How many changes (new stats or cache events) the engine has announced, once more
        than ``seen`` (what this returned to the caller before; 0 at first), or after
        ``timeout_s`` (``services.api.announce``)."""
        return await self._announced.wait(seen, timeout_s)

    def take_store_events(self) -> list[bytes]:
        """Block hashes the engine saw in the KV store since the last call (thread-safe)."""
        return self._core.take_store_events() if self._core is not None else []

    async def ready(self, timeout_s: float = 5.0) -> bool:
        if self._thread is None or self._dead is not None or self._loop is None:
            return False
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._send("probe", fut)
        try:
            return bool(await asyncio.wait_for(fut, timeout_s))
        except (TimeoutError, EngineUnavailable):
            return False

    async def abort(self, request_id: str) -> None:
        self._remember_abort(request_id)
        self._send("abort", request_id)

    def _remember_abort(self, request_id: str) -> None:
        now = time.monotonic()
        self._aborted[request_id] = now
        if len(self._aborted) > ABORT_MEMORY:  # dicts keep insertion order: the oldest go first
            for rid in list(self._aborted)[: len(self._aborted) - ABORT_MEMORY]:
                del self._aborted[rid]
        while self._aborted:
            rid, at = next(iter(self._aborted.items()))
            if now - at <= ABORT_MEMORY_S:
                break
            del self._aborted[rid]

    def aborted_since(self, request_id: str, since: float) -> bool:
        """Whether ``abort(request_id)`` was called at or after ``since`` (``time.monotonic()``):
        a call that began at ``since`` lost the race with its own abort. An abort from before
        the call (a failed earlier attempt of the request) does not count."""
        at = self._aborted.get(request_id)
        return at is not None and at >= since

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        async with aclosing(self._stream("add", request, None)) as items:  # closed now, not at GC
            async for item in items:
                assert isinstance(item, EngineOutput)
                yield item

    async def prefill(self, request: EngineRequest) -> AsyncIterator[EngineOutput | Handoff]:
        """Compute the prompt and sample the first token here; yields the outputs, then (if
        the request has not ended) a ``Handoff``: the sequence is gone from this engine (its
        blocks stay in the prefix cache). Refusals and failures as ``generate``."""
        async with aclosing(self._stream("add", request, "handoff")) as items:
            async for item in items:
                yield item

    async def resume(self, request: EngineRequest, payload: bytes) -> AsyncIterator[EngineOutput]:
        """Continue a sequence another engine handed off (``prefill``'s ``Handoff``) and stream
        the rest, as ``generate``. The request's reservation, if any, becomes the sequence's;
        without one the import may not take room promised to others. ``EngineRequestError``
        for a payload this engine must not use; ``EngineFull`` (nothing changed) when there
        is no room."""
        async with aclosing(self._stream("import", request, bytes(payload))) as items:
            async for item in items:
                assert isinstance(item, EngineOutput)
                yield item

    async def reserve(self, request_id: str, n_tokens: int, max_tokens: int = 0) -> bool:
        """Promise room for a sequence of ``n_tokens`` that may decode ``max_tokens`` more
        (``Reservations.reserve``); held until ``resume``, ``abort`` or ``release``."""
        return bool(await self._call("reserve", (request_id, int(n_tokens), int(max_tokens))))

    async def release(self, request_id: str) -> bool:
        return bool(await self._call("release", request_id))

    async def room(self) -> dict[str, int]:
        """What a new reservation could take now, and what is promised (``Reservations.room``)."""
        return dict(await self._call("room", None))

    async def store_usable(self, timeout_s: float = 1.0) -> bool:
        """Whether the engine's KV store can serve reads now (``EngineCore.store_usable``)."""
        if self._core is None:
            return False
        return bool(await asyncio.to_thread(self._core.store_usable, timeout_s))

    async def _call(self, kind: str, args: Any) -> Any:
        if self._dead is not None or self._thread is None or self._loop is None:
            raise EngineUnavailable(f"engine is not running: {self._dead or 'not started'}")
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._send(kind, (args, fut))
        return await fut

    async def _stream(
        self, kind: str, request: EngineRequest, extra: Any
    ) -> AsyncGenerator[EngineOutput | Handoff, None]:
        if self._dead is not None or self._thread is None or self._loop is None:
            raise EngineUnavailable(f"engine is not running: {self._dead or 'not started'}")
        began = time.monotonic()
        core_req, grammar = await asyncio.to_thread(self._prepare, request)
        if self.aborted_since(request.request_id, began):  # aborted before it reached the engine: never start
            log.info("request %s: aborted before it started", request.request_id)
            return
        sink: asyncio.Queue[EngineOutput | Handoff | BaseException] = asyncio.Queue()
        added: asyncio.Future[None] = self._loop.create_future()
        finished = False
        try:
            self._send(kind, (request, core_req, grammar, sink, added, extra))
            if self._dead is not None and not added.done():  # the thread stopped before reading it
                added.set_exception(EngineUnavailable(f"engine is not running: {self._dead}"))
            await added  # raises EngineRequestError if the scheduler refuses it
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = isinstance(item, Handoff) or item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:  # consumer gone (disconnect, stop sequence) or error: free the blocks
                self._send("abort", request.request_id)

    # -- caller side -----------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _prepare(self, request: EngineRequest) -> tuple[Any, Any]:
        """The engine's request and its compiled grammar (on the caller's worker thread, so a
        slow schema delays only its own request); EngineRequestError for bad params or schema."""
        from engine.core import CoreRequest
        from engine.structured.grammar import GrammarError

        params = _sampling_params(request)
        core_req = CoreRequest(
            request.request_id,
            tuple(request.prompt_token_ids),
            params,
            request.priority,
            request.traffic_class,
            swa_replay=request.swa_replay,
            images=self._encode(request),
        )
        if params.structured is None:
            return core_req, None
        try:
            return core_req, self._core.compile_grammar(params.structured)
        except GrammarError as exc:
            raise EngineRequestError(str(exc)) from None

    def _encode(self, request: EngineRequest) -> tuple[Any, ...]:
        """The request's images as engine inputs (key, encoder rows). Each image is an
        ``ImagePart`` (encoded here; cached by key), an ``EncodedImage`` (rows a vision-pool
        instance made, as a payload verified against this checkpoint's encoder: not encoded
        again) or an ``ImageInput`` (rows given as a tensor, taken as they are)."""
        if not request.images:
            return ()
        from engine.scheduler.request import ImageInput
        from engine.vision.stage import EncodedImage, ImagePart

        raw = [im for im in request.images if isinstance(im, ImagePart)]
        rows = [im for im in request.images if isinstance(im, EncodedImage)]
        if (raw and self._vision is None) or (rows and self._rows_format is None):
            if self._rows_format is not None:  # a deployment's engine: its vision pool encodes
                raise EngineRequestError(
                    "this engine takes images encoded by its vision pool, not raw images"
                )
            raise EngineRequestError(f"model {self._info.model_id!r} has no vision encoder: send text only")
        try:
            encoded = iter(self._vision.encode(raw) if raw else ())
            out = []
            for im in request.images:
                if isinstance(im, ImagePart):
                    out.append(next(encoded))
                elif isinstance(im, EncodedImage):
                    out.append(self._rows_format.image_input(im))
                elif isinstance(im, ImageInput):
                    out.append(im)
                else:
                    raise ValueError(
                        f"an image must be an ImagePart, EncodedImage or ImageInput, got {type(im).__name__}"
                    )
            return tuple(out)
        except ValueError as exc:  # PayloadError is a ValueError
            raise EngineRequestError(str(exc)) from None

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        live: dict[str, _Live] = {}
        try:
            while not self._stop.is_set():
                self._drain(live)
                if not self._core.has_work():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    # The KV store connector's counters move on its writer thread after the
                    # last step (the write-through of that step's blocks): republish them.
                    self._publish_stats()
                    continue
                self._apply(self._core.step(), live)
                self._publish_stats()
                self._publish_cache_events()
            self._stopped(live, None)
        except BaseException as exc:  # the engine died: fail everything, refuse what follows
            self._stopped(live, exc)

    def _run_lockstep(self) -> None:
        """The engine thread of an EP rank (``engine.distributed.lockstep``): every iteration
        the ranks agree whether any has a forward to run, then all run one (real or idle)."""
        live: dict[str, _Live] = {}
        ls = self._lockstep
        assert ls is not None
        try:
            idle_wait = _EP_IDLE_WAIT_S
            while True:
                self._drain(live)
                any_ready, any_stop = ls.agree(self._core.will_forward(), self._stop.is_set())
                if any_stop:
                    break
                if any_ready:
                    idle_wait = _EP_IDLE_WAIT_S
                    self._apply(ls.step(), live)
                    self._publish_stats()
                    self._publish_cache_events()
                    continue
                self._apply(self._core.housekeeping(), live)
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
            self._dead = err
        else:
            log.error("engine thread died", exc_info=exc)
            self._dead = exc
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
                        answer: Any = self.reservations.reserve(self._core, *args)
                    elif kind == "release":
                        answer = self.reservations.release(args)
                    else:
                        answer = self.reservations.room(self._core)
                except ValueError as exc:
                    answer = EngineRequestError(str(exc))
                self._publish_stats()  # before the answer: a caller reading stats sees the change
                self._resolve(fut, answer)
            elif kind == "abort":
                self.reservations.release(payload)
                # Scheduler side only: a step already in flight on the executor thread may still
                # read this request's sampling state; the executor drops it itself when the
                # next step lists the request among ``finished_ids``.
                if self._core.abort(payload):
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
            self._core.add(core_req, grammar)
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

        core, rid = self._core, request.request_id
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
        """EP and EPLB counters of a rank: forwards (idle ones apart), layers re-placed, and
        the last window's load imbalance (max/mean over ranks, mean over layers) under the
        placement that served it and under the one planned from it."""
        ls = self._lockstep
        if ls is None:
            return {}
        out = {"ep_forwards": float(ls.forwards), "ep_idle_passes": float(ls.idle_passes)}
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
            payload: bytes | None = self._core.export_sequence(rid)
            problem = None
        except (KeyError, ValueError) as exc:
            payload, problem = None, exc
        self._apply(self._core.take_outputs(), live)
        if rid not in live:  # it finished in a step that was in flight
            return
        live.pop(rid)
        if payload is None:
            self._core.abort(rid)
            self._core.take_outputs()
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
        if self._outbox is None:
            return
        batch = self._core.drain_events()
        if batch:
            with self._events_lock:
                self._outbox.publish(batch, self._core.cached_hashes)
            self._announced.announce()

    def _publish_stats(self) -> None:
        """Replace the published stats if they changed. ``stats_version`` counts the changes,
        so an idle engine's snapshot stays the same object: whoever pushes it on when it
        changes (``services.ray.actors``' ``watch``) sends nothing while nothing happens."""
        st = self._core.stats()
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
                **(self._vision.stats() if self._vision is not None else {}),
            },
        )
        if fresh == self._stats:
            return
        self._stats_version += 1
        fresh.extra["stats_version"] = float(self._stats_version)
        self._stats = fresh
        self._announced.announce()


def _sampling_params(request: EngineRequest) -> Any:
    from engine.sampling.params import SamplingParams, StructuredOutput

    structured = None
    if request.structured is not None:
        structured = StructuredOutput(**{request.structured.kind: request.structured.source})
    try:
        return SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            logprobs=request.top_logprobs,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            structured=structured,
        )
    except ValueError as exc:
        raise EngineRequestError(str(exc)) from None


def _read_model_info(model_dir: Path, engine_kwargs: dict[str, Any]) -> ModelInfo:
    config_path = model_dir / "config.json"
    tokenizer = model_dir / "tokenizer.json"
    if not config_path.is_file() or not tokenizer.is_file():
        raise ValueError(f"{model_dir} is not a checkpoint directory (needs config.json and tokenizer.json)")
    cfg = json.loads(config_path.read_text())
    context = int(cfg.get("max_position_embeddings", 4096))
    num_blocks = int(engine_kwargs.get("num_blocks", 256))
    context = min(context, num_blocks * 256)
    eos = cfg.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    layers, window = int(cfg["num_hidden_layers"]), int(cfg["sliding_window"])
    return ModelInfo(
        model_dir.resolve().name, context, int(cfg["vocab_size"]), eos_ids, str(tokenizer),
        (layers * (window - 1), window - 1), str(engine_kwargs.get("swa_replay", "exact")),
        vision=bool(cfg.get("vision")), vision_fingerprint=_vision_fingerprint(model_dir, cfg),
    )  # fmt: skip


def _vision_fingerprint(model_dir: Path, cfg: dict[str, Any]) -> str:
    if not cfg.get("vision"):
        return ""
    from engine.model.vision import vision_fingerprint

    return vision_fingerprint(model_dir)
