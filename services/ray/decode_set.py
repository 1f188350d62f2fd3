"""``DecodeSet``: the decode engines one router places requests on.

The router's decode policy (``sluice``: the 2D balancer over running requests x KV tokens)
picks an engine from the loads the engines push; the pick holds only once the engine
accepts a reservation for the request's tokens, so a full engine refuses before any work
is done (backpressure), and the policy picks again among the rest. All refusing is
``PoolFull`` (503 with Retry-After, nothing held).

The balancer's decode cost model (``d0 + d1*B + d2*K``; the 2D rule reads only its
crossover length ``d1 / d2``) starts from the one fitted to the step table measured beside
the checkpoint, or the default, and the set refits it to the decode steps the
engines have run and push with their loads (``costmodel.online``):

* **With a measured table**, placement uses the table's fit refitted with its ``d2`` kept:
  the table varies batch and depth apart, which pins the per-KV-token cost, and the served
  steps add what a table of forward passes does not time, the host's per-step and
  per-sequence work. Refitted on one of two served workloads, it predicted the other's
  steps with relative error 0.08-0.13 against the table fit's 0.16-0.20 (two runs;
  docs/router.md, "Refitted while serving").
* **With a measured table and speculating engines** (``speculating``), all three are
  refitted around the table's fit: the table times plain decode steps, whose per-KV-token
  cost is not a verification step's (every verified token reads the context), so its
  ``d2`` is not kept (docs/router.md, "A speculating decode engine").
* **Without one**, placement keeps the default and the refit of all three coefficients is
  only reported: refitted on one workload's steps, its crossover moved several-fold between
  runs (served traffic mostly moves batch and depth together).

``/metrics`` shows the placement model, the refit of all three, and how well each predicts
the served steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from costmodel import DecodeCostModel
from costmodel.online import DecodeStepSums, posterior
from services.api.engine_client import EngineBusy, EngineUnavailable
from services.ray.replica import RayEngineReplica
from services.routing.client import accepting


class PoolFull(EngineBusy):
    """No decode engine can take the request now (each refused its reservation); nothing is
    held for it. The API answers 503 with Retry-After: back off and retry."""


class DecodeSet:
    """The decode engines one router chooses among: started ``RayEngineReplica``s (decode
    role) whose pushed loads feed ``policy`` (a name of ``router.policy.DECODE_POLICIES``;
    ``"sluice"``: the 2D balancer, running requests x KV tokens). ``speculating``: the
    engines speculate, and a measured table's ``d2`` is refitted too (module doc)."""

    def __init__(
        self,
        replicas: Sequence[RayEngineReplica],
        policy: str = "sluice",
        decode_cost: Any = None,
        speculating: bool = False,
    ) -> None:
        import router.sluice  # noqa: F401  (registers "sluice" in DECODE_POLICIES)
        from router.policy import DECODE_POLICIES, PolicyContext

        if not replicas:
            raise ValueError("DecodeSet needs at least one decode engine")
        self.replicas = list(replicas)
        self.policy_name = policy
        # costmodel.DecodeCostModel: fitted to a step table measured on this hardware, else the default
        self.prior = decode_cost if decode_cost is not None else DecodeCostModel()
        self.profiled = decode_cost is not None
        # a table of plain decode steps pins the per-KV cost of plain steps only (module doc)
        self.keep_d2 = not speculating
        self.decode_cost = self.prior  # what placement uses (refit)
        self.steps = DecodeStepSums()  # the engines' served decode steps, summed (refit)
        self._refitted = (0.0, self.prior)  # (steps.w it was refitted at, model): `refitted`
        self.policy = DECODE_POLICIES.create(
            policy, PolicyContext(len(self.replicas), decode_cost=self.decode_cost)
        )
        self.placed = [0] * len(self.replicas)  # requests placed on each engine
        self.refused = 0  # reservations refused
        self._lock = asyncio.Lock()

    def refit(self) -> None:
        """Sum the steps the engines have pushed; when they pushed new ones and the prior is
        a measured table, refit the placement model to them (module docstring)."""
        steps = DecodeStepSums()
        for r in self.replicas:
            steps = steps + DecodeStepSums.from_extra(r.stats().extra)
        if steps.w == self.steps.w:
            return
        self.steps = steps
        if self.profiled:
            self.decode_cost = posterior(self.prior, steps, keep_d2=self.keep_d2)
            self.policy.ctx = dataclasses.replace(self.policy.ctx, decode_cost=self.decode_cost)

    @property
    def refitted(self) -> DecodeCostModel:
        """All three coefficients refitted to the summed steps: reported (``/metrics``), not
        placed with; computed when read, not on the request path."""
        if self._refitted[0] != self.steps.w:
            self._refitted = (self.steps.w, posterior(self.prior, self.steps))
        return self._refitted[1]

    def loads(self) -> list[Any]:
        """``EngineLoad`` per decode engine from its latest stats (pushed, or the answer to
        the last reservation, whichever is newer): requests in it or promised to it, and KV
        tokens held, owed to its waiting sequences, or promised. Owed tokens count: an
        overloaded engine's queue would otherwise look free in KV, and draw more."""
        from router.policy import EngineLoad

        out = []
        for i, r in enumerate(self.replicas):
            s = r.stats()
            out.append(
                EngineLoad(
                    i,
                    running=s.running + s.waiting + int(s.extra.get("reserved", 0)),
                    kv_tokens=int(
                        s.extra.get("kv_tokens", 0)
                        + s.extra.get("waiting_tokens", 0)
                        + s.extra.get("reserved_tokens", 0)
                    ),
                )
            )
        return out

    async def choose(self, request_id: str, n_tokens: int, max_tokens: int) -> int:
        """The index of the decode engine now holding a reservation for ``request_id``;
        ``PoolFull`` when every live engine refuses."""
        from router.policy import RequestView

        max_tokens = max(int(max_tokens), 0)
        async with self._lock:  # one choice at a time, so each sees the previous reservation
            candidates = [i for i, r in enumerate(self.replicas) if accepting(r)]
            if not candidates:
                raise EngineUnavailable(
                    f"no decode engine is up and accepting ({len(self.replicas)} configured)"
                )
            block_size = self.replicas[0].cache_identity()[0]
            view = RequestView(request_id, input_len=int(n_tokens), block_size=block_size)
            if self.profiled:  # else placement keeps the default: nothing to refit for it
                self.refit()
            while candidates:
                self.policy.update_loads(self.loads())
                len_ref = getattr(self.policy, "len_ref", None)
                e = self.policy.select(candidates, view)
                self.policy.on_complete(e, view)  # loads are re-read for every choice: charge nothing
                if await self.replicas[e].reserve(request_id, int(n_tokens), max_tokens):
                    self.placed[e] += 1
                    return e
                self.refused += 1
                if len_ref is not None:  # a refused pick is not a routed request
                    setattr(self.policy, "len_ref", len_ref)  # noqa: B010 (only some policies have it)
                candidates.remove(e)
        raise PoolFull(
            f"no decode engine can take {request_id!r} now ({n_tokens} tokens + {max_tokens} to decode): "
            "every engine refused its reservation. Retry later, lower max_tokens, or add decode engines."
        )

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(
            *(r.actor.abort.remote(request_id) for r in self.replicas if r.alive), return_exceptions=True
        )
