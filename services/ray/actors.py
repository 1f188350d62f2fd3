"""``EngineActor``: one ``EngineCore`` in a Ray actor, for the prefill or the decode role.

A plain class; wrap it at use time (``remote_engine_actor`` does, with the role's pool
resource), so importing this module never needs Ray. Every method takes and returns plain
data (ints, strings, lists, dicts, bytes). The handoff payload is the engine's own versioned
byte format (``EngineCore.export_sequence``), never a pickled Python object.

The actor's methods run one at a time (a plain Ray actor), and each runs the engine until
its request has what the call asks for, so one engine serves one call at a time. A prefill
call ends with the sequence exported and gone from the prefill engine (its blocks stay in
that engine's prefix cache, unreferenced); a decode call can stop after ``max_new_tokens``
so that a caller may ``abort`` between calls.

A decode actor can hold *reservations* (``reserve``): room promised to a request before its
handoff arrives, so that a chosen decode engine either takes the sequence or refuses up
front (backpressure) instead of failing the import. ``resume`` consumes the request's
reservation, ``abort`` / ``release`` give it back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

ROLES = ("prefill", "decode")
_MAX_STEPS = 100_000  # a call that steps this often without its request finishing is a bug


def sampling_params(sampling: Mapping[str, Any]) -> Any:
    """``SamplingParams`` from a plain dict of its fields (``structured`` as a dict)."""
    from engine.sampling.params import SamplingParams, StructuredOutput

    fields = dict(sampling)
    if isinstance(fields.get("structured"), Mapping):
        fields["structured"] = StructuredOutput(**fields["structured"])
    return SamplingParams(**fields)


class EngineActor:
    """One engine. ``engine_config``: ``EngineConfig`` fields as a dict (``model`` defaults
    to ``checkpoint``)."""

    def __init__(self, role: str, checkpoint: str, engine_config: Mapping[str, Any] | None = None) -> None:
        from engine.core import EngineConfig, EngineCore

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.core = EngineCore(EngineConfig(**{"model": str(checkpoint), **dict(engine_config or {})}))
        self._reserved: dict[str, tuple[int, int]] = {}  # request id -> (blocks, tokens) promised
        self.refused = 0  # reservations refused so far

    # -- prefill -----------------------------------------------------------------------------
    def prefill(
        self, request_id: str, prompt_token_ids: list[int], sampling: Mapping[str, Any]
    ) -> tuple[dict[str, Any], bytes]:
        """Run the prompt (every chunk of it), sample the first token, export the sequence.

        Returns (info, handoff). ``info``: ``request_id``, ``tokens`` (the outputs so far: the
        first token, rarely more), ``first_token``, ``finish_reason`` (set if the request ended
        here: a stop token first, or ``max_tokens`` reached), ``prompt_tokens``,
        ``cached_tokens``. ``handoff``: the sequence payload, ``b""`` if the request ended here.
        Either way nothing of the request is left on this engine. Raises ValueError for a
        request the engine refuses."""
        from engine.messages import CoreRequest

        core = self.core
        core.add(CoreRequest(request_id, tuple(int(t) for t in prompt_token_ids), sampling_params(sampling)))
        info: dict[str, Any] = {"request_id": request_id, "tokens": [], "finish_reason": None}
        try:
            for _ in range(_MAX_STEPS):
                self._absorb(info, core.step())
                if info["tokens"] or info["finish_reason"] is not None:
                    break
            else:
                raise RuntimeError(f"prefill of {request_id!r} produced no token in {_MAX_STEPS} steps")
            handoff = b""
            if info["finish_reason"] is None:
                handoff = core.export_sequence(request_id)
                self._absorb(info, core.take_outputs())  # steps that were in flight
        except BaseException:
            core.abort(request_id)
            core.take_outputs()
            raise
        info["first_token"] = info["tokens"][0] if info["tokens"] else None
        return info, handoff

    # -- decode ------------------------------------------------------------------------------
    def resume(self, handoff: bytes, max_new_tokens: int | None = None) -> dict[str, Any]:
        """Import a handed-off sequence and decode it: to its end (``max_tokens``, a stop
        token) or, with ``max_new_tokens``, until that many tokens came in this call (then
        ``decode`` continues it). Returns ``request_id``, ``tokens`` (new in this call),
        ``finish_reason`` (None while it runs). Raises ``PayloadError`` (ValueError) for a
        payload this engine must not use, ``EngineFull`` when it has no room; either way
        nothing changed.

        The request's reservation, if it has one, is consumed (its room is now the
        sequence's). Without one, the import must leave every other reservation's room free,
        else it is undone and ``EngineFull`` raised."""
        from engine.kvconnector.transfer import EngineFull

        core = self.core
        request_id = core.import_sequence(bytes(handoff))
        if self._reserved.pop(request_id, None) is None and self._reserved:
            room = self._room()
            if room["blocks"] < 0 or room["slots"] < 0 or room["seqs"] < 0:
                core.abort(request_id)
                core.take_outputs()
                raise EngineFull(
                    f"no room for sequence {request_id!r} beside {len(self._reserved)} reservations "
                    f"({room['reserved_blocks']} blocks): reserve first, or pick another engine"
                )
        return self.decode(request_id, max_new_tokens)

    def decode(self, request_id: str, max_new_tokens: int | None = None) -> dict[str, Any]:
        """Continue a resumed sequence (see ``resume``). KeyError if it is not running here."""
        core = self.core
        if request_id not in core.scheduler.requests:
            raise KeyError(f"no running request {request_id!r} on this engine")
        out: dict[str, Any] = {"request_id": request_id, "tokens": [], "finish_reason": None}
        try:
            for _ in range(_MAX_STEPS):
                self._absorb(out, core.step())
                if out["finish_reason"] is not None:
                    return out
                if max_new_tokens is not None and len(out["tokens"]) >= max_new_tokens:
                    return out
        except BaseException:
            core.abort(request_id)
            core.take_outputs()
            raise
        raise RuntimeError(f"decode of {request_id!r} did not finish in {_MAX_STEPS} steps")

    # -- reservations (decode) ---------------------------------------------------------------
    def reserve(self, request_id: str, n_tokens: int, max_tokens: int = 0) -> bool:
        """Promise room for a sequence of ``n_tokens`` tokens that may decode ``max_tokens``
        more: ``ceil((n_tokens + max_tokens) / block_size)`` blocks, an SWA slot and a place
        among ``max_num_seqs``. True (and held until ``resume``, ``abort`` or ``release``) if
        the engine has that room now beside what it already promised; False otherwise, and
        nothing is held. Reserving again for the same request replaces its reservation."""
        if self.role != "decode":
            raise ValueError(f"reserve is for the decode role; this actor is {self.role!r}")
        if n_tokens < 1 or max_tokens < 0:
            raise ValueError(f"reserve needs n_tokens >= 1 and max_tokens >= 0, got {n_tokens}, {max_tokens}")
        previous = self._reserved.pop(request_id, None)
        tokens = int(n_tokens) + int(max_tokens)
        blocks = -(-tokens // self.core.block_size)
        room = self._room()
        if blocks <= room["blocks"] and room["slots"] >= 1 and room["seqs"] >= 1:
            self._reserved[request_id] = (blocks, tokens)
            return True
        if previous is not None:
            self._reserved[request_id] = previous
        self.refused += 1
        return False

    def release(self, request_id: str) -> bool:
        """Give back the request's reservation; False if it has none."""
        return self._reserved.pop(request_id, None) is not None

    def _room(self) -> dict[str, int]:
        """What a new sequence could still have, from the engine's own numbers: blocks it can
        allocate (free, evictable cached, and retained slots' partial blocks: what an import
        may take) minus the blocks running sequences still need to reach their ``max_tokens``
        minus reserved blocks; SWA slots available minus reservations; places among
        ``max_num_seqs`` minus reservations. Negative when over-promised."""
        sched = self.core.scheduler
        cache, bs = sched.cache, self.core.block_size
        owed = sum(
            max(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) - len(r.block_table), 0)
            for r in sched.requests.values()
        )
        reserved_blocks = sum(b for b, _ in self._reserved.values())
        n = len(self._reserved)
        return {
            "blocks": cache.blocks.num_available + cache.slots.num_retained_partials - owed - reserved_blocks,
            "slots": cache.slots.num_available - n,
            "seqs": sched.config.max_num_seqs - len(sched.requests) - n,
            "owed_blocks": owed,
            "reserved_blocks": reserved_blocks,
        }

    @staticmethod
    def _absorb(acc: dict[str, Any], outputs: list[Any]) -> None:
        for o in outputs:
            if o.request_id != acc["request_id"]:
                continue  # one call owns the engine: only another call's late abort message
            acc["tokens"].extend(int(t) for t in o.new_token_ids)
            acc["prompt_tokens"], acc["cached_tokens"] = o.prompt_tokens, o.cached_tokens
            if o.finish_reason is not None:
                acc["finish_reason"] = o.finish_reason
                acc["error"] = o.error

    # -- either role -------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """End the request here and free its blocks, slot and reservation; False if none of
        them is here."""
        reserved = self._reserved.pop(request_id, None) is not None
        found = self.core.abort(request_id)
        self.core.take_outputs()  # its final "abort" message: nobody is waiting for it
        return found or reserved

    def stats(self) -> dict[str, Any]:
        """Counters, plain: ``held_blocks`` / ``held_slots`` / ``sequences`` are 0 when no
        request holds anything (cached blocks and retained slots are reclaimable, not held).
        ``reserved`` / ``reserved_blocks`` / ``reserved_tokens``: reservations held;
        ``owed_blocks``: blocks running sequences still need to reach ``max_tokens``;
        ``room_blocks``: what a new reservation may take (``reserve``); ``refused``: count."""
        core = self.core
        room = self._room()
        s = core.stats()
        cache = core.scheduler.cache
        retained_partials = cache.slots.num_retained_partials
        free_slots, total_slots = int(s.extra["free_swa_slots"]), int(s.extra["total_swa_slots"])
        return {
            "role": self.role,
            "pid": os.getpid(),
            "running": s.running,
            "waiting": s.waiting,
            "sequences": len(core.scheduler.requests),
            "free_blocks": s.free_blocks,
            "total_blocks": s.total_blocks,
            "held_blocks": s.total_blocks - s.free_blocks - retained_partials,
            "free_slots": free_slots,
            "total_slots": total_slots,
            "held_slots": total_slots - free_slots,
            "kv_tokens": s.kv_tokens,
            "steps": s.steps,
            "block_size": core.block_size,
            "max_num_seqs": core.scheduler.config.max_num_seqs,
            "reserved": len(self._reserved),
            "reserved_blocks": room["reserved_blocks"],
            "reserved_tokens": sum(t for _, t in self._reserved.values()),
            "owed_blocks": room["owed_blocks"],
            "room_blocks": room["blocks"],
            "refused": self.refused,
        }

    def close(self) -> None:
        self.core.close()


def remote_engine_actor(
    role: str,
    checkpoint: str,
    engine_config: Mapping[str, Any] | None = None,
    *,
    pool_resource: bool = True,
    **options: Any,
) -> Any:
    """Start an ``EngineActor`` on Ray; returns its handle. With ``pool_resource`` it asks for
    one unit of the role's resource ("prefill" / "decode", as ``init_local_ray`` offers);
    ``options`` go to ``ray.remote(...).options``. Observed with Ray 2.60 on the local
    cluster: an actor started with Ray's defaults keeps a CPU of ``available_resources`` while
    it lives, so pass ``num_cpus=0`` to place engines by their pool resource alone (the decode
    pool tests do)."""
    import ray

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    opts: dict[str, Any] = dict(options)
    if pool_resource:
        opts["resources"] = {role: 1, **opts.get("resources", {})}
    return ray.remote(EngineActor).options(**opts).remote(role, str(checkpoint), dict(engine_config or {}))
