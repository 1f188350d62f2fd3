"""``InProcessEngineClient``: the engine core (``engine/core.py``) on a background thread, bridged to asyncio.

The thread (``services.api.engine_thread.EngineThread``) owns the ``EngineCore`` and steps it;
this client is its asyncio side: it queues commands (add, import, abort, reserve, probe) and
awaits the answers, which the thread puts into one ``asyncio.Queue`` per request. ``stats()``
returns the snapshot the thread published last, so it never reads engine state across threads.

Grammar compilation (which may take up to the compiler's time limit) runs on the caller's
worker thread, not the engine thread: a slow schema delays only its own request.

Disaggregated serving uses three more calls (the Ray engine actors wrap this class):
``prefill(request)`` streams the first output(s) and then a ``Handoff`` with the sequence's
payload (``EngineCore.export_sequence``, taken between steps right after the step that
sampled the first token), after which nothing of the request is running here;
``resume(request, payload)`` imports such a payload and streams the rest as ``generate``
does; ``reserve`` / ``release`` promise room to a sequence before its payload arrives
(``Reservations``), so a decode engine takes it or refuses up front.

With ``cache_event_capacity > 0`` the engine records prefix-cache events, which the engine
thread moves into a bounded outbox after every step; a router drains them with
``take_cache_events``. ``changed(seen, timeout_s)`` returns once either moved on (new stats
or cache events), so a watcher that pushes them on sleeps while the engine is idle instead
of polling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.api.engine_client import (
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
    ModelInfo,
)
from services.api.engine_thread import EngineThread
from services.api.handoff import Handoff, Reservations

log = logging.getLogger(__name__)
# An abort is remembered this long (and at most this many), so that a call whose abort raced
# its start does not start the request afterwards (``aborted_since``).
ABORT_MEMORY_S = 600.0
ABORT_MEMORY = 65_536


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
        self.ep_store = ep_store  # () -> torch.distributed.Store: the group's rendezvous (default: ep's file)
        self.ep_interface = ep_interface or "lo"
        self._info = _read_model_info(self.model_dir, self.engine_kwargs)
        # request ids aborted lately (their time): a request whose abort arrived before it was
        # sent to the engine (it raced its own start, e.g. during a handoff's fetch) never starts
        self._aborted: dict[str, float] = {}
        self._engine = EngineThread()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._vision: Any = None  # engine.vision.stage.VisionStage when the checkpoint has an encoder
        self._rows_format: Any = None  # engine.vision.stage.RowsFormat: rows encoded elsewhere

    @property
    def reservations(self) -> Reservations:
        """Room promised to sequences on their way (the engine thread's own: read, never change)."""
        return self._engine.reservations

    @property
    def _core(self) -> Any:
        """engine.core.EngineCore (None before ``start`` and after ``close``), owned by the
        engine thread: this side calls only its thread-safe parts."""
        return self._engine.core

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        thread = self._engine
        if thread.started:
            return
        from engine.core import EngineConfig, EngineCore

        self._loop = asyncio.get_running_loop()
        thread.bind(self._loop)
        if self.ep is None:
            config = EngineConfig(model=str(self.model_dir), **self.engine_kwargs)
            thread.core = await asyncio.to_thread(EngineCore, config)
        else:
            config = EngineConfig(
                model=str(self.model_dir), **{**self.engine_kwargs, "async_scheduling": False},
                ep_size=self.ep.size, ep_rank=self.ep.rank,
            )  # fmt: skip
            thread.core = await asyncio.to_thread(self._join_group, config)
        if self._info.vision:
            from engine.vision.stage import RowsFormat, VisionStage

            dtype = thread.core.runner.cfg.torch_dtype
            if self.encode_images:
                self._vision = thread.vision = await asyncio.to_thread(
                    VisionStage.from_model_dir, self.model_dir, config.device, dtype
                )
            # rows a vision pool made must come from this checkpoint's encoder
            self._rows_format = await asyncio.to_thread(RowsFormat.from_model_dir, self.model_dir, dtype)
        sharing = thread.core.slot_sharing
        if sharing is not None:  # the replica's slot server, for a router reading the directory
            pool = sharing.pool
            self._info = replace(
                self._info, swa_holder=sharing.holder, swa_directory=config.swa_directory,
                swa_slot_exact=not pool.lossy,
                swa_slot_replay=self._info.swa_replay_tokens[1] if pool.layers is not None else 0,
            )  # fmt: skip
        if config.cache_event_capacity and thread.core.records_events():
            from engine.scheduler.cache_events import CacheEventOutbox

            thread.outbox = CacheEventOutbox(config.cache_event_capacity)
        thread.start()

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
            self._engine.lockstep = Lockstep(core, group)
            return core
        from engine.config import ModelConfig
        from services.eplb.engine import EngineEplb, initial_placement

        experts = ModelConfig.from_dir(config.model).n_routed_experts
        placement = initial_placement(self.eplb, experts, self.ep.size, self.ep.rank)
        core = EngineCore(config, ep_group=group, placement=placement)
        eplb = EngineEplb(self.eplb, core.runner.model.moe_layers(), self.ep.rank, group)
        self._engine.lockstep = Lockstep(core, group, eplb)
        return core

    async def close(self) -> None:
        await self._engine.close()

    # -- EngineClient ----------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        return self._engine.stats

    @property
    def alive(self) -> bool:
        """Started and its engine thread has not stopped or died (cheap; no round trip)."""
        return self._engine.started and self._engine.dead is None

    @property
    def failed(self) -> BaseException | None:
        """Why the engine thread died, if it did (not for a clean ``close``)."""
        dead = self._engine.dead
        return None if isinstance(dead, EngineUnavailable) else dead

    def cache_identity(self) -> tuple[int, Any]:
        """(block size, ``ExtraKeys``): how this engine names cached blocks. After ``start``."""
        if self._core is None:
            raise EngineUnavailable("engine is not started")
        return self._core.block_size, self._core.extra_keys

    def take_cache_events(self) -> Any:
        """Prefix-cache events since the last call, as a ``CacheEventBatch`` (empty when the
        engine records none). Safe from the event loop; never blocks on the engine."""
        return self._engine.take_cache_events()

    async def changed(self, seen: int, timeout_s: float) -> int:
        """How many changes (new stats or cache events) the engine has announced, once more
        than ``seen`` (what this returned to the caller before; 0 at first), or after
        ``timeout_s`` (``services.api.announce``)."""
        return await self._engine.announced.wait(seen, timeout_s)

    def take_store_events(self) -> list[bytes]:
        """Block hashes the engine saw in the KV store since the last call (thread-safe)."""
        return self._core.take_store_events() if self._core is not None else []

    async def ready(self, timeout_s: float = 5.0) -> bool:
        if not self._engine.started or self._engine.dead is not None or self._loop is None:
            return False
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._engine.send("probe", fut)
        try:
            return bool(await asyncio.wait_for(fut, timeout_s))
        except (TimeoutError, EngineUnavailable):
            return False

    async def abort(self, request_id: str) -> None:
        self._remember_abort(request_id)
        self._engine.send("abort", request_id)

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
        fut: asyncio.Future[Any] = self._running_loop().create_future()
        self._engine.send(kind, (args, fut))
        return await fut

    async def _stream(
        self, kind: str, request: EngineRequest, extra: Any
    ) -> AsyncGenerator[EngineOutput | Handoff, None]:
        loop = self._running_loop()
        began = time.monotonic()
        core_req, grammar = await asyncio.to_thread(self._prepare, request)
        if self.aborted_since(request.request_id, began):  # aborted before it reached the engine: never start
            log.info("request %s: aborted before it started", request.request_id)
            return
        sink: asyncio.Queue[EngineOutput | Handoff | BaseException] = asyncio.Queue()
        added: asyncio.Future[None] = loop.create_future()
        finished = False
        try:
            self._engine.send(kind, (request, core_req, grammar, sink, added, extra))
            dead = self._engine.dead
            if dead is not None and not added.done():  # the thread stopped before reading it
                added.set_exception(EngineUnavailable(f"engine is not running: {dead}"))
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
                self._engine.send("abort", request.request_id)

    # -- caller side -----------------------------------------------------------------------
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of a running engine; EngineUnavailable when it is not running."""
        dead = self._engine.dead
        if dead is not None or not self._engine.started or self._loop is None:
            raise EngineUnavailable(f"engine is not running: {dead or 'not started'}")
        return self._loop

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
