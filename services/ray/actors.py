"""``EngineActor``: one engine in a Ray actor, for the prefill, decode or colocated role.

An asyncio actor around ``InProcessEngineClient``: the engine runs on its own thread inside
the actor and batches every request the actor holds (continuous batching), while the
actor's event loop serves the calls. A plain class: ``remote_engine_actor`` wraps it with
the role's pool resource at use time, so importing this module never needs Ray.

Every call takes and returns plain data (``services.ray.wire``); the handoff payload is the
engine's versioned byte format, never a pickled object. Errors travel as data too
(``{"error": {"kind", "message"}}``), so no exception object is pickled across processes:

* ``prefill(request)`` (two returns): the first outputs, then the payload (``b""`` when
  the request ended here): its bytes, or under the gRPC transport a ticket to fetch them
  by (``services.ray.handoff``). The caller passes its ObjectRef on to a decode actor
  without fetching it.
* ``resume(request, payload)`` / ``generate(request)``: streaming generators of outputs.
* ``drop_handoff(request_id)``: the request ended; a payload held for it goes.
* ``reserve`` / ``release`` / ``room``: room promised before a handoff arrives.
* ``watch(interval_s)``: a streaming generator that *pushes* this engine's state (load
  counters, prefix-cache events, blocks seen in the KV store) whenever it changed, at most
  once per ``interval_s``; the router consumes it instead of polling engines per request.
  It wakes when the engine publishes (``InProcessEngineClient.changed``), and otherwise
  every ``WATCH_IDLE_REFRESH_S`` for what moves beside the engine (the actor's handoff
  counters): an idle engine's watch no longer polls at ``interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict
from typing import Any

from services.ray.feeds import Feeds

ROLES = ("prefill", "decode", "colocated")
# Ray restarts a crashed engine actor this many times (its process, then ``start`` loads the
# engine again); a crash loop beyond that leaves the engine down for good.
DEFAULT_MAX_RESTARTS = 3
ERROR_KINDS = ("request", "full", "unavailable", "lost")
# How often ``watch`` looks at an idle engine: for the state the engine does not announce (the
# actor's own handoff counters), which thus reaches the router at most this late. Polling at
# the push interval (10 ms) instead cost each idle actor 2 % of a core
# (`scripts/idle_stack_cpu.py`).
WATCH_IDLE_REFRESH_S = 0.1
LOG_FORMAT = "%(asctime)s %(levelname)s sluice.engine[%(role)s pid %(process)d] %(message)s"


def engine_log(role: str) -> logging.LoggerAdapter[logging.Logger]:
    """The engine actor's log: INFO and above to this process's stderr (Ray keeps a worker's
    stderr in its session's ``logs/worker-*.err``), each line naming the role and pid, and
    each request line its request id, the same id the API process logs."""
    logger = logging.getLogger("sluice.engine")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logging.LoggerAdapter(logger, {"role": role})


def error_of(exc: BaseException) -> dict[str, Any]:
    """An exception as plain data: kind "request" (the request's fault, a 4xx), "full" (no
    room now: backpressure), "lost" (its handoff payload cannot be had: prefill it again) or
    "unavailable" (the engine cannot serve)."""
    from engine.kvconnector.handoff_server import HandoffFetchError
    from engine.kvconnector.transfer import EngineFull
    from services.api.engine_client import EngineRequestError

    if isinstance(exc, EngineRequestError):
        kind = "request"
    elif isinstance(exc, EngineFull):
        kind = "full"
    elif isinstance(exc, HandoffFetchError):
        kind = "lost"
    else:
        kind = "unavailable"
    return {"error": {"kind": kind, "message": str(exc) or repr(exc)}}


def raise_error(item: Mapping[str, Any]) -> None:
    """Raise what ``error_of`` encoded, if ``item`` carries an error."""
    from engine.kvconnector.transfer import EngineFull
    from services.api.engine_client import EngineRequestError, EngineUnavailable, HandoffLost

    err = item.get("error") if isinstance(item, Mapping) else None
    if not err:
        return
    cls = {"request": EngineRequestError, "full": EngineFull, "lost": HandoffLost}.get(
        err["kind"], EngineUnavailable
    )
    raise cls(err["message"])


class EngineActor:
    """``engine_config``: ``EngineConfig`` fields as a dict (``model`` is ``checkpoint``)."""

    def __init__(
        self,
        role: str,
        checkpoint: str,
        engine_config: Mapping[str, Any] | None = None,
        ep: Mapping[str, Any] | None = None,
        eplb: Mapping[str, Any] | None = None,
        handoff: Mapping[str, Any] | None = None,
    ) -> None:
        """``ep``: ``engine.distributed.lockstep.EPMember`` fields when this engine is one rank
        of an expert-parallel group (``start`` then joins the group: every rank must start),
        plus ``rendezvous``: the name of the group's ``RendezvousActor`` to meet through;
        ``eplb``: ``EplbConfig`` fields to balance the group's experts while serving;
        ``handoff``: ``services.ray.handoff.HandoffConfig`` fields (default: object store)."""
        from engine.distributed.netif import gloo_interface
        from services.api.inprocess import InProcessEngineClient
        from services.ray.handoff import ActorHandoffs, HandoffConfig

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        member = dict(ep) if ep else None
        rendezvous = member.pop("rendezvous", None) if member else None
        self.client = InProcessEngineClient(
            checkpoint,
            ep=member,
            eplb=dict(eplb) if eplb else None,
            ep_store=_ray_store(rendezvous) if rendezvous else None,
            # gloo on the interface of this host's Ray node IP: loopback on a one-host cluster
            ep_interface=gloo_interface(_node_ip()) if member else None,
            **dict(engine_config or {}),
        )
        self._closed = False
        self._starting = asyncio.Lock()
        self.log = engine_log(role)
        self.handoffs = ActorHandoffs(HandoffConfig(**dict(handoff or {})), role, self.log)
        self.feeds = Feeds()  # the pushed state, once per router that follows this engine
        # finishing what it holds, taking nothing new: pushed with the stats, so every router
        # (one per API process) stops giving it work; a restarted actor starts undrained
        self.draining = False

    async def start(self) -> dict[str, Any]:
        """Load the engine (once: later calls only answer); returns what a router needs to
        know of it. After Ray restarts a crashed actor, this loads the engine again."""
        from services.ray.wire import extra_keys_to_wire

        async with self._starting:
            if self.client.failed:  # its engine died in this process (an EP peer lost): no restart here
                raise RuntimeError(
                    f"this engine failed and cannot start again in this actor: {self.client.failed!r}"
                )
            if not self.client.alive:
                await self.client.start()
            self.handoffs.start()
        block_size, extra = self.client.cache_identity()
        return {
            "role": self.role,
            "pid": os.getpid(),
            "node_ip": _node_ip(),
            "block_size": int(block_size),
            "extra_keys": extra_keys_to_wire(extra),
            "model_info": asdict(self.client.model_info()),
            "handoff": self.handoffs.config.transport,
            "handoff_address": self.handoffs.server.address if self.handoffs.server else "",
        }

    # -- requests ----------------------------------------------------------------------------
    async def prefill(
        self, request: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], bytes | dict[str, Any]]:
        """Run the prompt, sample the first token, export the sequence (see the module doc)."""
        from services.api.handoff import Handoff
        from services.ray.wire import output_to_wire, request_from_wire

        outputs: list[dict[str, Any]] = []
        rid = request.get("request_id", "?")
        began = time.monotonic()
        try:
            async for item in self.client.prefill(request_from_wire(request)):
                if isinstance(item, Handoff):
                    if self.client.aborted_since(rid, began):  # aborted while it was exported: hold nothing
                        self.log.info("request %s: aborted as it was handed off", rid)
                        return outputs, b""
                    self.log.info("request %s: prefilled, handing off %d bytes", rid, len(item.payload))
                    return outputs, self.handoffs.offer(rid, item.payload)
                outputs.append(output_to_wire(item))
        except Exception as exc:  # noqa: BLE001 - travels as data (see the module doc)
            self.log.warning("request %s: prefill failed: %s", rid, exc)
            outputs.append(error_of(exc))
        self.log.info("request %s: ended in its prefill", rid)
        return outputs, b""

    async def resume(
        self, request: Mapping[str, Any], payload: bytes | Mapping[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Import a handed-off sequence (its payload's bytes, or a ticket to fetch them by)
        and stream the rest of it. A payload that cannot be fetched gives back the request's
        reservation and answers kind "lost"."""
        from engine.kvconnector.handoff_server import is_ticket
        from services.ray.wire import request_from_wire

        rid = request.get("request_id", "?")
        if is_ticket(payload):
            began = time.monotonic()
            try:
                payload = await asyncio.to_thread(self.handoffs.fetch, payload)
            except Exception as exc:  # noqa: BLE001 - travels as data
                self.log.warning("request %s: handoff fetch failed: %s", rid, exc)
                await self.client.release(rid)
                yield error_of(exc)
                return
            self.log.info(
                "request %s: fetched a %d-byte handoff in %.1f ms", rid, len(payload),
                (time.monotonic() - began) * 1e3,
            )  # fmt: skip
            if self.client.aborted_since(rid, began):  # the client left during the fetch: import nothing
                self.log.info("request %s: aborted during its handoff's fetch", rid)
                return
        assert isinstance(payload, bytes)
        self.log.info("request %s: resuming from a %d-byte handoff", rid, len(payload))
        async for item in self._outputs(
            self.client.resume(request_from_wire(request), payload), rid, self.log
        ):
            yield item

    async def generate(self, request: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The whole request on this engine (colocated)."""
        from services.ray.wire import request_from_wire

        rid = request.get("request_id", "?")
        self.log.info("request %s: generating", rid)
        async for item in self._outputs(self.client.generate(request_from_wire(request)), rid, self.log):
            yield item

    @staticmethod
    async def _outputs(
        stream: Any, rid: str, log: logging.LoggerAdapter[Any]
    ) -> AsyncIterator[dict[str, Any]]:
        from services.ray.wire import output_to_wire

        n, reason = 0, None
        try:
            async for out in stream:
                n += len(out.token_ids)
                reason = out.finish_reason or reason
                yield output_to_wire(out)
        except Exception as exc:  # noqa: BLE001 - travels as data
            log.warning("request %s: failed after %d tokens: %s", rid, n, exc)
            yield error_of(exc)
        finally:
            await stream.aclose()
            log.info(
                "request %s: %d tokens streamed, %s", rid, n, f"finished ({reason})" if reason else "stopped"
            )

    async def abort(self, request_id: str) -> None:
        self.handoffs.drop(request_id)
        await self.client.abort(request_id)

    async def drop_handoff(self, request_id: str) -> bool:
        """The request ended: the payload held for it (gRPC transport) goes."""
        return self.handoffs.drop(request_id)

    async def reserve(self, request_id: str, n_tokens: int, max_tokens: int = 0) -> bool:
        return await self.client.reserve(request_id, n_tokens, max_tokens)

    async def reserve_and_report(self, request_id: str, n_tokens: int, max_tokens: int = 0) -> dict[str, Any]:
        """``reserve``, answered with this engine's stats after it: ``{"ok", "stats"}``."""
        ok = await self.client.reserve(request_id, n_tokens, max_tokens)
        return {"ok": ok, "stats": self._stats()}

    async def release(self, request_id: str) -> bool:
        return await self.client.release(request_id)

    async def store_usable(self, timeout_s: float = 1.0) -> bool:
        return await self.client.store_usable(timeout_s)

    async def room(self) -> dict[str, int]:
        return await self.client.room()

    async def set_draining(self, draining: bool) -> dict[str, Any]:
        """Drain this engine (``True``: the routers stop giving it new requests; it finishes
        the ones it holds) or make it a candidate again. Answers with the stats after it."""
        if draining != self.draining:
            self.log.info("draining" if draining else "accepting requests again")
        self.draining = bool(draining)
        return self._stats()

    # -- state -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        """``EngineStats`` as a dict, with this process's pid (a restarted engine has another)."""
        return self._stats_of(self.client.stats(), self._own_stats())

    def _own_stats(self) -> dict[str, float]:
        return {"draining": float(self.draining), **self.handoffs.stats()}

    @staticmethod
    def _stats_of(engine: Any, own: dict[str, float]) -> dict[str, Any]:
        st = asdict(engine)
        st["extra"]["pid"] = float(os.getpid())
        st["extra"].update(own)
        return st

    async def ready(self) -> bool:
        return await self.client.ready()

    async def watch(self, interval_s: float = 0.01, subscriber: str = "") -> AsyncIterator[dict[str, Any]]:
        """Push this engine's state whenever it changed (see the module doc). Each item:
        ``stats`` (``EngineStats`` as a dict), ``events`` (prefix-cache events, wire form),
        ``store_seen`` (block hashes seen in the KV store). The first item is sent at once,
        with a snapshot of the engine's cache. Every router (one per API process) follows
        with its own ``subscriber`` name and gets every event (``services.ray.feeds``)."""
        from services.ray.wire import events_to_wire

        name = subscriber or f"anonymous-{id(asyncio.current_task())}"
        self.feeds.subscribe(name)
        last: tuple[Any, dict[str, float]] | None = None  # (the engine's snapshot, ours)
        announced = 0  # the engine's announced changes this watch has looked at
        try:
            while not self._closed and self.client.alive:
                self.feeds.pump(self.client.take_cache_events(), self.client.take_store_events())
                # the engine replaces its snapshot only when it changed: no copy while idle
                now = (self.client.stats(), self._own_stats())
                events, seen = self.feeds.take(name)
                if last is None or now[0] is not last[0] or now[1] != last[1] or events or seen:
                    stats = self._stats_of(*now)
                    yield {"stats": stats, "events": events_to_wire(events), "store_seen": list(seen)}
                    last = now
                await asyncio.sleep(interval_s)  # at most one push per interval
                announced = await self.client.changed(announced, WATCH_IDLE_REFRESH_S)  # asleep while idle
        finally:
            self.feeds.unsubscribe(name)

    async def close(self) -> None:
        self._closed = True
        self.handoffs.close()
        await self.client.close()


def _node_ip() -> str:
    """The address the Ray cluster knows this actor's host by."""
    import ray

    return str(ray.util.get_node_ip_address())


def _ray_store(name: str) -> Any:
    """A function giving the rendezvous store of actor ``name`` (services.ray.rendezvous)."""

    def store() -> Any:
        import ray

        from services.ray.rendezvous import RayStore

        return RayStore(ray.get_actor(name))

    return store


def ray_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` for ``ray.remote(...).options`` with ``GPU`` and ``CPU`` moved out of
    ``resources`` into ``num_gpus`` / ``num_cpus``: Ray refuses them as custom resources
    (a pool's per-rank resources name them together with the pool's own)."""
    out = dict(opts)
    resources = dict(out.pop("resources", None) or {})
    if "GPU" in resources:
        out["num_gpus"] = resources.pop("GPU")
    if "CPU" in resources:
        out["num_cpus"] = resources.pop("CPU")
    out["resources"] = resources
    return out


def remote_engine_actor(
    role: str,
    checkpoint: str,
    engine_config: Mapping[str, Any] | None = None,
    *,
    pool_resource: bool = True,
    ep: Mapping[str, Any] | None = None,
    eplb: Mapping[str, Any] | None = None,
    handoff: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """Start an ``EngineActor`` on Ray; returns its handle (call ``start`` next). With
    ``pool_resource`` it asks for one unit of the role's resource ("prefill" / "decode";
    colocated engines take "decode"), as ``init_local_ray`` offers; ``options`` go to
    ``ray.remote(...).options``. Observed with Ray 2.60 on the local cluster: an actor with
    Ray's defaults keeps a CPU of ``available_resources`` while it lives, so pass
    ``num_cpus=0`` to place engines by their pool resource alone."""
    import ray

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    opts: dict[str, Any] = {"max_concurrency": 1000, "max_restarts": DEFAULT_MAX_RESTARTS, **options}
    if pool_resource:
        resource = "prefill" if role == "prefill" else "decode"
        opts["resources"] = {resource: 1, **opts.get("resources", {})}
    return (
        ray.remote(EngineActor)
        .options(**ray_options(opts))
        .remote(
            role,
            str(checkpoint),
            dict(engine_config or {}),
            dict(ep) if ep else None,
            dict(eplb) if eplb else None,
            dict(handoff) if handoff else None,
        )
    )
