"""``DecodePool``: choose a decode ``EngineActor`` by the router's 2D balancer, and reserve.

For each request the pool reads every decode actor's ``stats()`` (one Ray call each, in
parallel), gives the router's decode policy (``router.sluice.TwoDimDecode`` by default:
running requests x KV tokens, docs/router.md "Decode: the 2D balancer") those loads, and
asks the chosen actor to ``reserve`` room for the sequence (its tokens plus its decode
budget). An actor that refuses is dropped from the candidates and the rule picks again
among the rest; when every actor refuses, ``PoolFull`` is raised: backpressure, decided
before any KV moves, never an out-of-memory error in the importer.

Loads are pulled per choice for now; the issue asks for state pushed by the engines later
(the router's ``update_loads`` already takes it). The router's own capacity filter is not
fed (no ``kv_capacity``): the reservation is the capacity check, made by the engine with
its own numbers (free and evictable blocks, SWA slots, ``max_num_seqs``, blocks promised).

``PooledGenerator`` runs one request: prefill on the prefill actor, then choose+reserve a
decode actor, then ``resume`` there with the handoff's ObjectRef (which consumes the
reservation). If anything fails after the choice, the request is aborted on the chosen
actor, which frees its sequence or its reservation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from services.ray.disagg import DisaggResult, resume_on, run_prefill


class PoolFull(RuntimeError):
    """No decode actor can take the request now (each refused its reservation). Nothing is
    held for it. Back off and retry later, or give the pool more decode engines or blocks."""

    def __init__(self, message: str, request_id: str, n_tokens: int, max_tokens: int) -> None:
        super().__init__(message)
        self.request_id, self.n_tokens, self.max_tokens = request_id, n_tokens, max_tokens


class DecodePool:
    """``actors``: handles of decode ``EngineActor``s. ``policy``: a decode policy name of
    ``router.policy.DECODE_POLICIES`` (``"sluice"``: the 2D balancer)."""

    def __init__(
        self, actors: Sequence[Any], policy: str = "sluice", timeout_s: float | None = 120.0
    ) -> None:
        import router.sluice  # noqa: F401  (registers "sluice" in DECODE_POLICIES)
        from router.policy import DECODE_POLICIES, PolicyContext

        if not actors:
            raise ValueError("DecodePool needs at least one decode actor")
        self.actors, self.timeout_s = list(actors), timeout_s
        self.policy = DECODE_POLICIES.create(policy, PolicyContext(len(self.actors)))

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors], timeout=self.timeout_s)

    @staticmethod
    def loads_of(stats: Sequence[Mapping[str, Any]]) -> list[Any]:
        """``EngineLoad`` per actor: requests in it (running, waiting, reserved) and KV
        tokens (computed by running sequences, plus the tokens reserved)."""
        from router.policy import EngineLoad

        return [
            EngineLoad(
                i,
                running=int(s["running"] + s["waiting"] + s["reserved"]),
                kv_tokens=int(s["kv_tokens"] + s["reserved_tokens"]),
            )
            for i, s in enumerate(stats)
        ]

    def choose(self, request_id: str, n_tokens: int, max_tokens: int = 0) -> int:
        """The index of the decode actor that now holds a reservation for ``request_id`` (a
        sequence of ``n_tokens`` tokens that may decode ``max_tokens`` more). Raises
        ``PoolFull`` when every actor refuses."""
        import ray

        from router.policy import RequestView

        stats = self.stats()
        self.policy.update_loads(self.loads_of(stats))
        request = RequestView(request_id, input_len=int(n_tokens), block_size=int(stats[0]["block_size"]))
        candidates = list(range(len(self.actors)))
        while candidates:
            len_ref = getattr(self.policy, "len_ref", None)
            e = self.policy.select(candidates, request)
            self.policy.on_complete(e, request)  # the next choice reads fresh loads: charge nothing
            ok = ray.get(
                self.actors[e].reserve.remote(request_id, int(n_tokens), int(max_tokens)),
                timeout=self.timeout_s,
            )
            if ok:
                return e
            if len_ref is not None:  # a refused pick is not a routed request: keep the EMA as it was
                self.policy.len_ref = len_ref
            candidates.remove(e)
        raise PoolFull(self._full_message(request_id, n_tokens, max_tokens), request_id, n_tokens, max_tokens)

    def release(self, index: int, request_id: str) -> bool:
        import ray

        return ray.get(self.actors[index].release.remote(request_id), timeout=self.timeout_s)

    def _full_message(self, request_id: str, n_tokens: int, max_tokens: int) -> str:
        stats, parts = self.stats(), []
        for i, s in enumerate(stats):
            parts.append(
                f"decode[{i}]: room for {s['room_blocks']} blocks ({s['free_blocks']} free, "
                f"{s['owed_blocks']} owed to running sequences, {s['reserved_blocks']} reserved), "
                f"{s['free_slots'] - s['reserved']} SWA slots, {s['sequences']}+{s['reserved']}/"
                f"{s['max_num_seqs']} sequences"
            )
        bs = int(stats[0]["block_size"])
        need = -(-(int(n_tokens) + int(max_tokens)) // bs)
        return (
            f"no decode engine can take {request_id!r} now: it needs {need} blocks of {bs} tokens "
            f"({n_tokens} tokens + {max_tokens} to decode), an SWA slot and a sequence place; "
            + "; ".join(parts)
            + ". Retry after running requests finish (backpressure), lower max_tokens, or add "
            "decode engines or num_blocks."
        )


@dataclass
class PooledResult(DisaggResult):
    decode_index: int | None = None  # the pool's actor that decoded it (None: not handed off)


class PooledGenerator:
    """One request through a prefill actor and a ``DecodePool``."""

    def __init__(self, prefill: Any, pool: DecodePool, timeout_s: float | None = 120.0) -> None:
        self.prefill, self.pool, self.timeout_s = prefill, pool, timeout_s

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Mapping[str, Any]
    ) -> PooledResult:
        """Prefill, choose+reserve, resume. Raises ``PoolFull`` (nothing held anywhere) when
        no decode actor has room; the prefill's handoff is then dropped."""

        from services.ray.actors import sampling_params

        max_tokens = sampling_params(sampling).max_tokens
        result, handoff_ref = run_prefill(
            self.prefill, request_id, prompt_token_ids, sampling, self.timeout_s, PooledResult
        )
        if result.finish_reason is not None:
            return cast(PooledResult, result)
        n_tokens = int(result.info["prompt_tokens"]) + len(result.tokens)
        e = self.pool.choose(request_id, n_tokens, max_tokens - len(result.tokens))
        out = resume_on(self.pool.actors[e], request_id, handoff_ref, self.timeout_s)
        result.tokens += out["tokens"]
        result.finish_reason, result.handed_off = out["finish_reason"], True
        pooled = cast(PooledResult, result)
        pooled.decode_index = e
        return pooled

    def abort(self, request_id: str) -> bool:
        """End the request wherever it is (prefill actor, any decode actor's sequence or
        reservation); True if anything was freed."""
        import ray

        actors = [self.prefill, *self.pool.actors]
        return any(ray.get([a.abort.remote(request_id) for a in actors], timeout=self.timeout_s))
