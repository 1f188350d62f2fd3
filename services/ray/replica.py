"""The API process's view of engine actors: ``RayEngineReplica`` (the decode engines' placement,
``DecodeSet``, is in ``services.ray.decode_set``).

``RayEngineReplica`` is an ``EngineActor`` seen as the router's ``ReplicaEngine`` (what
``services.routing.client.RoutedEngineClient`` routes over). Its state is **pushed**: on
``start`` it opens the actor's ``watch`` stream and keeps the latest load counters, the
prefix-cache events and the store sightings as they arrive, so the router reads local
memory and never calls an engine per request. A replica whose stream breaks (the actor
died) is no longer ``alive``.

A prefill replica with a ``DecodeSet`` serves a request disaggregated: prefill on its
actor, decode on one of the set's, resumed on another if that one dies
(``services.ray.disaggregated``). Without one, its actor runs each request whole. A request
whose consumer stops (client gone) or that fails is aborted on the actor holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import ExtraKeys
from services.api.engine_client import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    EngineUnavailable,
    ModelInfo,
)
from services.ray.actors import raise_error
from services.ray.disaggregated import disaggregated
from services.ray.feeds import merge
from services.ray.metrics import RequestClock

if TYPE_CHECKING:
    from services.ray.decode_set import DecodeSet
    from services.ray.disaggregated import _Handoff
    from services.ray.metrics import PoolMetrics

log = logging.getLogger(__name__)


class RayEngineReplica:
    """One ``EngineActor`` (started: ``info`` is what its ``start`` returned). ``decode``:
    the decode engines a prefill replica hands its requests to (None: the actor runs each
    request whole, colocated). ``name`` labels logs and metrics; ``metrics``
    (``services.ray.metrics.PoolMetrics``) receives the latencies seen here. ``lookup``
    returns the actor now registered under this engine's name: an API replica that did not
    start the actors follows them through it when its EP group is restarted (new actors)."""

    def __init__(
        self,
        actor: Any,
        info: Mapping[str, Any],
        decode: DecodeSet | None = None,
        *,
        name: str = "",
        metrics: PoolMetrics | None = None,
        lookup: Callable[[], Any] | None = None,
        watch_interval_s: float = 0.01,
        call_timeout_s: float = 60.0,
        restart_timeout_s: float = 300.0,
    ) -> None:
        from services.ray.wire import extra_keys_from_wire

        self.actor, self.info, self.decode, self.name = actor, dict(info), decode, name
        self.metrics = metrics
        self.pool = str(info.get("role", "prefill"))
        self.lookup = lookup
        self.subscriber = f"{socket.gethostname()}:{os.getpid()}"  # this API process, as the actor's feed
        self.watch_interval_s, self.call_timeout_s = watch_interval_s, call_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self._identity = (int(info["block_size"]), extra_keys_from_wire(info["extra_keys"]))
        mi = info["model_info"]
        self._model = ModelInfo(
            **{
                **mi,
                "eos_token_ids": tuple(mi["eos_token_ids"]),
                "swa_replay_tokens": tuple(mi.get("swa_replay_tokens", (0, 0))),
            }
        )
        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0)
        self._events = CacheEventBatch()
        self._store_seen: list[bytes] = []
        self._watch: asyncio.Task[None] | None = None
        self._first_push: asyncio.Event | None = None
        self._alive = False
        self.down_at: float | None = None  # time.monotonic() when it last went down
        self.restarts = 0  # times Ray restarted the actor and its engine came back
        self.recoveries = 0  # requests continued after their decode engine died
        self.handoffs: dict[str, _Handoff] = {}  # in-flight disaggregated requests: their handoff point
        # the actor keeps each payload it exported until told the request ended (gRPC transport)
        self.holds_payloads = info.get("handoff") == "grpc"

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._watch is not None:
            return
        self._first_push = asyncio.Event()
        self._alive = True
        self._watch = asyncio.create_task(self._follow(), name=f"sluice-watch-{self.name}")
        await asyncio.wait_for(self._first_push.wait(), self.call_timeout_s)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
            self._watch = None
        self._alive = False

    async def rebind(self, actor: Any, info: Mapping[str, Any]) -> None:
        """Follow a new actor in this replica's place (its EP group was restarted whole): the
        router keeps its index and learns that the engine's cache is empty. A replica still
        up until now goes down here: the restart ends its actor (its own stream may not have
        broken yet, when the supervisor acted on a peer's death first)."""
        if self._alive:
            self.down_at = time.monotonic()
        await self.close()
        self.actor, self.info = actor, dict(info)
        self._events = CacheEventBatch(snapshot=())
        self.restarts += 1
        await self.start()
        log.warning("engine %s is back in a restarted group (pid %s)", self.name, self.info["pid"])

    async def _follow(self) -> None:
        """Keep the pushed state; when the stream breaks the engine is down. Ray restarts a
        crashed actor (``max_restarts``): then ``start`` loads the engine again, the router
        learns that its cache is empty, and the replica is up again in its place."""
        assert self._first_push is not None
        while True:
            try:
                await self._consume()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor died or was killed
                log.warning("engine %s stopped pushing state: %r", self.name, exc)
            self._alive = False
            self.down_at = time.monotonic()
            self._first_push.set()
            try:  # waits while Ray restarts the actor; fails if it will not
                self.info = await asyncio.wait_for(self._start_again(), self.restart_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - gone for good
                log.error("engine %s is gone: %r", self.name, exc)
                return
            self.restarts += 1
            self._events = CacheEventBatch(snapshot=())  # a fresh engine holds no cached block
            log.warning("engine %s is back (restart %d, pid %s)", self.name, self.restarts, self.info["pid"])

    async def _start_again(self) -> dict[str, Any]:
        """``start`` on the actor once Ray has restarted it: a call made while it restarts
        is refused as unavailable, so try again until it answers or is dead for good."""
        import ray

        while True:
            try:
                return dict(await self.actor.start.remote())
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.2)
            except ray.exceptions.ActorDiedError:
                if self.lookup is None:
                    raise
                await asyncio.sleep(0.2)  # its group is being restarted: follow the new actor
                with contextlib.suppress(ValueError):  # not registered yet
                    self.actor = self.lookup()

    async def _consume(self) -> None:
        from services.ray.wire import events_from_wire

        assert self._first_push is not None
        stream = self.actor.watch.options(num_returns="streaming").remote(
            self.watch_interval_s, self.subscriber
        )
        async for ref in stream:
            item = await ref
            self._offer(item["stats"])
            self._events = merge(self._events, events_from_wire(item["events"]))
            self._store_seen.extend(bytes(h) for h in item["store_seen"])
            self._alive = True
            self._first_push.set()

    # -- ReplicaEngine ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    def model_info(self) -> ModelInfo:
        return self._model

    def cache_identity(self) -> tuple[int, ExtraKeys]:
        return self._identity

    def take_cache_events(self) -> CacheEventBatch:
        out, self._events = self._events, CacheEventBatch()
        return out

    def take_store_events(self) -> list[bytes]:
        out, self._store_seen = self._store_seen, []
        return out

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def draining(self) -> bool:
        """Finishing what it holds, taking nothing new (the engine's pushed flag: set from any
        API process, seen by every router)."""
        return bool(self._stats.extra.get("draining", 0.0))

    def holds_nothing(self) -> bool:
        """No request running or waiting, no reservation and no handoff payload (pushed state)."""
        st = self._stats
        return (
            st.running + st.waiting + st.extra.get("reserved", 0.0) + st.extra.get("handoffs_held", 0.0) == 0
        )

    @property
    def drained(self) -> bool:
        """Draining, and holding nothing any more."""
        return self.draining and self.holds_nothing()

    async def set_draining(self, draining: bool) -> None:
        """Drain the engine, or make it a candidate again; this process's view follows at once."""
        self._offer(await self._get(self.actor.set_draining.remote(draining)))

    async def ready(self, timeout_s: float = 5.0) -> bool:
        if not self._alive:
            return False
        try:
            return bool(await asyncio.wait_for(self.actor.ready.remote(), timeout_s))
        except Exception:  # noqa: BLE001 - a probe never raises
            return False

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.abort.remote(request_id), self.call_timeout_s)
        if self.decode is not None:
            await self.decode.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._alive:
            raise EngineUnavailable(f"engine {self.name} is down")
        if self.decode is None:
            clock = RequestClock(self.metrics, request.request_id, self.pool, self.name)
            async with aclosing(self._stream("generate", request)) as outs:
                async for out in outs:
                    clock.tokens(out)
                    yield out
            clock.done()
            return
        async with aclosing(disaggregated(self, request)) as outs:
            async for out in outs:
                yield out

    async def reserve(self, request_id: str, n_tokens: int, max_tokens: int) -> bool:
        """Ask the actor to reserve room (decode role); its answer carries its stats after
        the reservation, which replace the pushed ones at once. A dead actor refuses."""
        try:
            answer = await asyncio.wait_for(
                self.actor.reserve_and_report.remote(request_id, int(n_tokens), int(max_tokens)),
                self.call_timeout_s,
            )
        except Exception:  # noqa: BLE001 - a dead or stuck engine refuses
            return False
        self._offer(answer["stats"])
        return bool(answer["ok"])

    def _offer(self, stats: Mapping[str, Any]) -> None:
        """Take ``stats`` if they are newer than what is held (pushes and answers race; a
        restarted engine, another pid, counts afresh)."""
        version = stats.get("extra", {}).get("stats_version", 0.0)
        pid = stats.get("extra", {}).get("pid", 0.0)
        held = self._stats.extra
        if pid != held.get("pid", pid) or version >= held.get("stats_version", -1.0):
            self._stats = EngineStats(**stats)

    # -- the request paths -----------------------------------------------------------------
    async def _stream(
        self, method: str, request: EngineRequest, *args: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        """Outputs of this actor's streaming call ``method``; the request is aborted here
        unless it ended."""
        from services.ray.wire import output_from_wire, request_to_wire

        finished = False
        try:
            call = getattr(self.actor, method).options(num_returns="streaming")
            async for ref in call.remote(request_to_wire(request), *args):
                item = await self._get(ref)
                raise_error(item)
                out = output_from_wire(item)
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.actor.abort.remote(request.request_id), self.call_timeout_s)

    async def _get(self, ref: Any) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise ActorDied(f"engine actor {self.name} died: {exc}") from None
        except ray.exceptions.RayError as exc:  # e.g. an argument (a handoff payload) was lost
            raise CallFailed(f"engine actor {self.name} could not run the call: {exc}") from None


class ActorDied(EngineUnavailable):
    """The engine actor's process died during a call (killed, crashed, its node lost)."""


class CallFailed(EngineUnavailable):
    """Ray could not run a call on a live actor (an argument object was lost or freed)."""
