"""A prefill replica's disaggregated request path: ``disaggregated(replica, request)``, how a
``RayEngineReplica`` with a ``DecodeSet`` serves a request (the replica keeps the state:
its in-flight ``handoffs``, its ``recoveries``):

1. ``prefill`` on the replica's actor: the first token comes back and is yielded at once; the
   handoff payload (its bytes, or a ticket under the gRPC transport: ``services.ray.handoff``)
   stays in Ray's object store (its ObjectRef is never fetched here);
2. ``DecodeSet.choose``: the router's decode policy (the 2D balancer by default) over the
   decode engines' pushed loads, then a reservation on the chosen one; a refusal tries the
   next best; all refusing is ``PoolFull`` (backpressure, nothing held);
3. ``resume`` on the decode actor with the payload's ObjectRef (Ray moves the bytes
   between the two actors, or the decode actor fetches them from the prefill actor by the
   ticket); its outputs stream through.

If the consumer stops (client gone) or anything fails, the request is aborted on whichever
actor holds it, which frees its blocks, slot and reservation there. If the decode engine
dies, the request recovers on another (``disaggregated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.api.engine_client import EngineOutput, EngineRequest, EngineUnavailable, HandoffLost
from services.ray.actors import raise_error
from services.ray.metrics import RequestClock

if TYPE_CHECKING:
    from services.ray.replica import RayEngineReplica

log = logging.getLogger("services.ray.replica")  # the request lines, beside the replica's

MAX_RECOVERIES = 2  # a request moves to a new decode engine at most this often
STORE_PROBE_S = 1.0  # how long a store node may take to answer the health check of a recovery


async def disaggregated(
    replica: RayEngineReplica, request: EngineRequest
) -> AsyncGenerator[EngineOutput, None]:
    """``request``'s outputs from prefill replica ``replica``: reserve on a decode engine,
    prefill on ``replica``, hand over (see the module doc). The reservation comes first, so
    a full decode pool refuses before any work is done.

    Recovery: if the decode engine dies mid-stream, the sequence is resumed on another
    decode engine from the same handoff payload (still in Ray's object store, or in the
    prefill engine's outbox under the gRPC transport); if that payload is gone too, the
    request is prefilled again on ``replica`` (its prefix blocks come from the KV store) and
    handed off anew. Either way the engine recomputes tokens the client already has: they
    are checked against what was sent and dropped, so no token is duplicated or lost
    (outputs are deterministic for a seed). At most ``MAX_RECOVERIES`` times; then, or when
    no engine can take it, or when the payload is gone and the KV store does not answer (a
    prefill from nothing is not a recovery), the stream ends with ``EngineUnavailable``."""
    assert replica.decode is not None
    sent: list[int] = []  # every token id the client has received
    handoff = replica.handoffs[request.request_id] = _Handoff()
    handoff.clock = RequestClock(replica.metrics, request.request_id, replica.pool, replica.name)
    try:
        async with aclosing(_recovering(replica, request, sent, handoff)) as outs:
            async for out in outs:
                yield out
        handoff.clock.done()
    finally:
        replica.handoffs.pop(request.request_id, None)
        if replica.holds_payloads:  # the handoff point is no longer needed
            with contextlib.suppress(Exception):
                replica.actor.drop_handoff.remote(request.request_id)


async def _recovering(
    replica: RayEngineReplica, request: EngineRequest, sent: list[int], handoff: _Handoff
) -> AsyncGenerator[EngineOutput, None]:
    """The request's outputs across recoveries (see ``disaggregated``)."""
    cached: int | None = None
    attempt = 0
    while True:
        try:
            async with aclosing(_handoff_once(replica, request, sent, handoff)) as outs:
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
                if not await _store_usable(replica):
                    raise EngineUnavailable(
                        f"request {request.request_id!r} cannot continue: its decode engine died, its "
                        f"handoff payload is gone and the KV store does not answer ({lost})"
                    ) from None
            replica.recoveries += 1
            log.warning(
                "request %s: decode engine lost after %d tokens (%s); recovering %s",
                request.request_id, len(sent), lost,
                "from its handoff payload" if handoff.payload_ref is not None else "by prefilling again",
            )  # fmt: skip


async def _store_usable(replica: RayEngineReplica) -> bool:
    try:
        return bool(
            await asyncio.wait_for(replica.actor.store_usable.remote(STORE_PROBE_S), 2 * STORE_PROBE_S + 1)
        )
    except Exception:  # noqa: BLE001 - a prefill engine that cannot say: no
        return False


async def _handoff_once(
    replica: RayEngineReplica, request: EngineRequest, sent: list[int], handoff: _Handoff
) -> AsyncGenerator[EngineOutput, None]:
    """One try: reserve, prefill (unless ``handoff`` holds a payload already), resume.
    Yields the outputs beyond the ``sent`` tokens; ``handoff`` keeps the payload's ref and
    how many tokens it holds beyond the prompt."""
    from services.ray.replica import ActorDied, CallFailed  # (replica.py imports this module)

    assert replica.decode is not None
    rid = request.request_id
    # a resumed payload starts after the tokens it holds; a new prefill from the start
    skip = _Skipper(rid, sent[handoff.tokens :] if handoff.payload_ref is not None else sent)
    n_prompt = len(request.prompt_token_ids)
    chosen = await replica.decode.choose(rid, n_prompt + 1, request.max_tokens - 1)
    target = replica.decode.replicas[chosen]
    clock = handoff.clock
    log.info(
        "request %s: prefill on %s, decode on %s (%d prompt tokens%s)", rid, replica.name, target.name,
        n_prompt, ", resumed from its handoff payload" if handoff.payload_ref is not None else "",
    )  # fmt: skip
    resumed = False
    try:
        if handoff.payload_ref is None:
            finished = False
            async with aclosing(_prefill(replica, request, handoff)) as firsts:
                async for first in firsts:
                    finished = first.finish_reason is not None
                    kept = skip(first)
                    if kept is not None:
                        clock.tokens(kept)
                        yield kept
            if finished:
                return
        payload_ref = handoff.payload_ref
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
                await asyncio.wait_for(target.actor.release.remote(rid), replica.call_timeout_s)


async def _prefill(
    replica: RayEngineReplica, request: EngineRequest, handoff: _Handoff
) -> AsyncGenerator[EngineOutput, None]:
    """The prefill engine's part: its first outputs (the prompt's first token, or the whole
    answer where it ends there), with the handoff payload's ref and token count kept in
    ``handoff``; the request is aborted there if its outputs cannot be read."""
    from services.ray.wire import output_from_wire, request_to_wire

    rid = request.request_id
    first_ref, handoff.payload_ref = replica.actor.prefill.options(num_returns=2).remote(
        request_to_wire(request)
    )
    handoff.tokens = 0
    try:
        first = await replica._get(first_ref)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(replica.actor.abort.remote(rid), replica.call_timeout_s)
        raise
    if not first:
        raise EngineUnavailable(f"prefill of {rid!r} returned nothing")
    for item in first:
        raise_error(item)
        out = output_from_wire(item)
        handoff.tokens += len(out.token_ids)
        yield out


class _Handoff:
    """A request's handoff point: the payload's ObjectRef (None before the prefill, or once
    it is lost) and how many output tokens it holds (the prefill's)."""

    def __init__(self) -> None:
        self.payload_ref: Any = None
        self.tokens = 0
        self.clock = RequestClock(None, "", "", "")


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
