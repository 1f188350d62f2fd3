"""The API process's view of engine actors: ``RayEngineReplica`` (the decode engines' placement,
``DecodeSet``, is in ``services.ray.decode_set``).

``RayEngineReplica`` is an ``EngineActor`` seen as the router's ``ReplicaEngine`` (what
``services.routing.client.RoutedEngineClient`` routes over). Its state is **pushed**: on
``start`` it opens the actor's ``watch`` stream and keeps the latest load counters, the
prefix-cache events and the store sightings as they arrive, so the router reads local
memory and never calls an engine per request. A replica whose stream breaks (the actor
died) is no longer ``alive``.

A prefill replica with a ``DecodeSet`` serves a request disaggregated:

1. ``prefill`` on its actor: the first token comes back and is yielded at once; the
   handoff payload (its bytes, or a ticket under the gRPC transport: ``services.ray.handoff``)
   stays in Ray's object store (its ObjectRef is never fetched here);
2. ``DecodeSet.choose``: the router's decode policy (the 2D balancer by default) over the
   decode engines' pushed loads, then a reservation on the chosen one; a refusal tries the
   next best; all refusing is ``PoolFull`` (backpressure, nothing held);
3. ``resume`` on the decode actor with the payload's ObjectRef (Ray moves the bytes
   between the two actors, or the decode actor fetches them from the prefill actor by the
   ticket); its outputs stream through.

If the consumer stops (client gone) or anything fails, the request is aborted on whichever
actor holds it, which frees its blocks, slot and reservation there.
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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.scheduler.cache_events import CacheEventBatch
from engine.scheduler.hashing import ExtraKeys
from services.api.engine_client import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    EngineUnavailable,
    HandoffLost,
    ModelInfo,
)
from services.ray.actors import raise_error
from services.ray.feeds import merge
from services.ray.metrics import RequestClock

if TYPE_CHECKING:
    from services.ray.decode_set import DecodeSet
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
        async with aclosing(self._disaggregated(request)) as outs:
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

    async def _disaggregated(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Reserve on a decode engine, prefill here, hand over (see the module doc). The
        reservation comes first, so a full decode pool refuses before any work is done.

        Recovery: if the decode engine dies mid-stream, the sequence is resumed on another
        decode engine from the same handoff payload (still in Ray's object store, or in the
        prefill engine's outbox under the gRPC transport); if that
        payload is gone too, the request is prefilled again here (its prefix blocks come
        from the KV store) and handed off anew. Either way the engine recomputes tokens the
        client already has: they are checked against what was sent and dropped, so no
        token is duplicated or lost (outputs are deterministic for a seed). At most
        ``MAX_RECOVERIES`` times; then, or when no engine can take it, or when the payload
        is gone and the KV store does not answer (a prefill from nothing is not a recovery),
        the stream ends with ``EngineUnavailable``."""
        assert self.decode is not None
        sent: list[int] = []  # every token id the client has received
        handoff = self.handoffs[request.request_id] = _Handoff()
        handoff.clock = RequestClock(self.metrics, request.request_id, self.pool, self.name)
        try:
            async with aclosing(self._recovering(request, sent, handoff)) as outs:
                async for out in outs:
                    yield out
            handoff.clock.done()
        finally:
            self.handoffs.pop(request.request_id, None)
            if self.holds_payloads:  # the handoff point is no longer needed
                with contextlib.suppress(Exception):
                    self.actor.drop_handoff.remote(request.request_id)

    async def _recovering(
        self, request: EngineRequest, sent: list[int], handoff: _Handoff
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs across recoveries (see ``_disaggregated``)."""
        cached: int | None = None
        attempt = 0
        while True:
            try:
                async with aclosing(self._handoff_once(request, sent, handoff)) as outs:
                    async for out in outs:
                        if cached is None:
                            cached = out.cached_tokens  # the first prefill's hits are the request's
                        sent.extend(out.token_ids)
                        yield replace(out, cached_tokens=cached)
                return
            except _DecodeLost as lost:
                attempt += 1
                if attempt > MAX_RECOVERIES:
                    raise EngineUnavailable(
                        f"request {request.request_id!r} lost its decode engine {attempt} times: {lost}"
                    ) from None
                if lost.payload_ref is None:  # the payload is gone: prefill again, from the store
                    handoff.payload_ref = None
                    if not await self._store_usable():
                        raise EngineUnavailable(
                            f"request {request.request_id!r} cannot continue: its decode engine died, its "
                            f"handoff payload is gone and the KV store does not answer ({lost})"
                        ) from None
                self.recoveries += 1
                log.warning(
                    "request %s: decode engine lost after %d tokens (%s); recovering %s",
                    request.request_id, len(sent), lost,
                    "from its handoff payload" if handoff.payload_ref is not None else "by prefilling again",
                )  # fmt: skip

    async def _store_usable(self) -> bool:
        try:
            return bool(
                await asyncio.wait_for(self.actor.store_usable.remote(STORE_PROBE_S), 2 * STORE_PROBE_S + 1)
            )
        except Exception:  # noqa: BLE001 - a prefill engine that cannot say: no
            return False

    async def _handoff_once(
        self, request: EngineRequest, sent: list[int], handoff: _Handoff
    ) -> AsyncGenerator[EngineOutput, None]:
        """One try: reserve, prefill (unless ``handoff`` holds a payload already), resume.
        Yields the outputs beyond the ``sent`` tokens; ``handoff`` keeps the payload's ref and
        how many tokens it holds beyond the prompt."""
        from services.ray.wire import output_from_wire, request_to_wire

        assert self.decode is not None
        rid = request.request_id
        payload_ref = handoff.payload_ref
        # a resumed payload starts after the tokens it holds; a new prefill from the start
        skip = _Skipper(rid, sent[handoff.tokens :] if payload_ref is not None else sent)
        n_prompt = len(request.prompt_token_ids)
        chosen = await self.decode.choose(rid, n_prompt + 1, request.max_tokens - 1)
        target = self.decode.replicas[chosen]
        clock = handoff.clock
        log.info(
            "request %s: prefill on %s, decode on %s (%d prompt tokens%s)", rid, self.name, target.name,
            n_prompt, ", resumed from its handoff payload" if payload_ref is not None else "",
        )  # fmt: skip
        resumed = False
        try:
            if payload_ref is None:
                first_ref, payload_ref = self.actor.prefill.options(num_returns=2).remote(
                    request_to_wire(request)
                )
                handoff.payload_ref, handoff.tokens = payload_ref, 0
                try:
                    first = await self._get(first_ref)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.actor.abort.remote(rid), self.call_timeout_s)
                    raise
                last: EngineOutput | None = None
                for item in first:
                    raise_error(item)
                    last = output_from_wire(item)
                    handoff.tokens += len(last.token_ids)
                    kept = skip(last)
                    if kept is not None:
                        clock.tokens(kept)
                        yield kept
                if last is None:
                    raise EngineUnavailable(f"prefill of {rid!r} returned nothing")
                if last.finish_reason is not None:
                    return
            resumed = True
            clock.hand_to(target.name)
            try:
                # the payload holds the computed prompt: its images (rows included) stay here
                resume = target._stream("resume", replace(request, images=()), payload_ref)
                async with aclosing(resume) as outs:
                    async for out in outs:
                        kept = skip(out)
                        if kept is not None:
                            clock.tokens(kept)
                            yield kept
            except ActorDied as exc:  # the handoff point may still be there: resume from it
                raise _DecodeLost(str(exc), payload_ref) from None
            except (CallFailed, HandoffLost) as exc:  # the payload could not be read: prefill again
                raise _DecodeLost(str(exc), None) from None
            except EngineUnavailable as exc:  # its engine failed (an EP peer died): resume elsewhere
                raise _DecodeLost(str(exc), payload_ref) from None
        finally:
            if not resumed:  # the reservation is unused: give it back
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(target.actor.release.remote(rid), self.call_timeout_s)


MAX_RECOVERIES = 2  # a request moves to a new decode engine at most this often
STORE_PROBE_S = 1.0  # how long a store node may take to answer the health check of a recovery


class _Handoff:
    """A request's handoff point: the payload's ObjectRef (None before the prefill, or once
    it is lost) and how many output tokens it holds (the prefill's)."""

    def __init__(self) -> None:
        self.payload_ref: Any = None
        self.tokens = 0
        self.clock = RequestClock(None, "", "", "")


class ActorDied(EngineUnavailable):
    """The engine actor's process died during a call (killed, crashed, its node lost)."""


class CallFailed(EngineUnavailable):
    """Ray could not run a call on a live actor (an argument object was lost or freed)."""


class _DecodeLost(Exception):
    """The decode engine of a request died; ``payload_ref`` is its handoff payload if that
    is still readable, else None."""

    def __init__(self, message: str, payload_ref: Any) -> None:
        super().__init__(message)
        self.payload_ref = payload_ref


class _Skipper:
    """Drops the tokens a recomputed stream repeats (the client has them), checking that
    they are the same ones; returns what is new, or None when nothing is."""

    def __init__(self, request_id: str, sent: list[int]) -> None:
        self.request_id, self.sent, self.seen = request_id, list(sent), 0

    def __call__(self, out: EngineOutput) -> EngineOutput | None:
        ids = list(out.token_ids)
        n = min(len(self.sent) - self.seen, len(ids))
        if n > 0:
            if ids[:n] != self.sent[self.seen : self.seen + n]:
                raise EngineUnavailable(
                    f"request {self.request_id!r}: the recomputed stream differs from what was sent; ending it"
                )
            self.seen += n
            lps = (
                out.logprobs[n:]
                if out.logprobs is not None and len(out.logprobs) == len(ids)
                else out.logprobs
            )
            out = replace(out, token_ids=tuple(ids[n:]), logprobs=lps if n < len(ids) else None)
        if not out.token_ids and out.finish_reason is None:
            return None
        return out
