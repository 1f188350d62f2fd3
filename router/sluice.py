"""``sluice``: length tiers + prefix affinity for prefill, the 2D balancer for decode.

Prefill, for request r with L input tokens on candidate engine e::

    cached_e = min(matched_blocks_e * block_size, L)          (global prefix index)
    pred_e   = cost.prefill_time(L, cached_e)                  (quadratic cost model)
    comp_e   = pred_e minus any KV-store fetch time in it      (= pred_e without a store)
    score_e  = wait_e + pred_e + rho * (comp_e - min_f comp_f) (estimated TTFT on e, plus
                                                                the recompute it causes)
    score_e  = score_e * (1 + cross_tier_factor)               if e is not in r's tier

and r goes to ``argmin score_e``. ``wait_e = max(busy_until_e - now, 0)``, a virtual clock
per engine advanced by ``pred`` of every request routed to it (FIFO) and re-anchored by
engine reports. Cached tokens and queued work trade off in one unit (seconds). ``rho``
(``recompute_weight``) charges tokens recomputed although another engine holds them: that
compute is taken from the whole pool and its later requests, not only from r; with
``rho = 0`` the rule is greedy earliest-TTFT and gives up hits too easily. The tier penalty
keeps tiers apart (short requests never queue behind a 200K prefill on their own tier)
but lets a long cached prefix pull a request across a tier boundary when that is cheaper.
After choosing, the request's blocks are predicted in the index for e at once (the engine
will hold them when it finishes; its events confirm or end the prediction), so a burst of
requests sharing a prefix follows the first.

Decode, for a request with L context tokens, over engines with (running r_e, KV tokens k_e),
with the decode cost model ``step = d0 + d1 * B + d2 * K`` (``ctx.decode_cost``; the bench
fits it to step times measured on the engine)::

    w       = d2 * L / (d1 + d2 * L)            the share of the request's step cost due to its KV
    score_e = (1 - w) * (r_e + 1) / r_ref + w * (k_e + L) / k_ref
    r_ref   = mean(r) + 1,  k_ref = mean(k) + L

A short request (w ~ 0) weighs concurrency: it goes to a GPU with few requests even if
their caches are long. A long request (w ~ 1) weighs KV: it goes to a GPU with a small
cache even if it runs more requests. The crossover, w = 1/2, is at L = d1 / d2 tokens: the
KV that costs a step as much as one more request, so the weights come from the measured
model, not from a constant. Engines whose KV capacity cannot take L are skipped while
any engine can. ``TwoDimConfig.rule`` selects the alternatives measured against it
(docs/router.md): ``normalized`` (w = L / (L + L_ref), L_ref an EMA of routed lengths: the
earlier rule), ``relative`` (w = L / (L + sum(k) / sum(r))), ``step_time`` (the least
predicted step time after placement) and ``marginal`` (that plus what the request adds to
each step of the requests already there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from router.policy import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    EngineLoad,
    NoCandidates,
    Policy,
    PolicyContext,
    RequestView,
    argmin_tiebreak,
    candidates_array,
)
from router.tiers import TierConfig, TierPlanner


@dataclass(frozen=True)
class SluicePrefillConfig:
    tiers: TierConfig = field(default_factory=TierConfig)
    cross_tier_factor: float = 0.1  # soft: see the tier ablation in docs/router.md
    recompute_weight: float = 20.0  # tuned on both Mooncake traces, see docs/router.md
    recompute_gain: float = 0.0  # > 0: rho = clip(gain * mean requests in flight, 1, recompute_weight)
    use_tiers: bool = True
    wait_estimate: str = "virtual_clock"  # or "outstanding": sum of unfinished predicted work
    store_fetch_s_per_block: float | None = None  # None: ignore the KV store's directory

    def __post_init__(self) -> None:
        if self.wait_estimate not in ("virtual_clock", "outstanding"):
            raise ValueError(
                f"wait_estimate must be 'virtual_clock' or 'outstanding', got {self.wait_estimate!r}"
            )
        if self.store_fetch_s_per_block is not None and self.store_fetch_s_per_block < 0:
            raise ValueError(
                f"store_fetch_s_per_block must be >= 0 or None, got {self.store_fetch_s_per_block}"
            )
        if self.cross_tier_factor < 0 or self.recompute_weight < 0 or self.recompute_gain < 0:
            raise ValueError(
                f"cross_tier_factor, recompute_weight and recompute_gain must be >= 0, got "
                f"{self.cross_tier_factor}, {self.recompute_weight}, {self.recompute_gain}"
            )


@PREFILL_POLICIES.register("sluice")
class SluicePrefill(Policy):
    name = "sluice"

    def __init__(self, ctx: PolicyContext, config: SluicePrefillConfig | None = None) -> None:
        super().__init__(ctx)
        self.config = config or SluicePrefillConfig()
        self.index = ctx.shared_index()
        self.planner = TierPlanner(self.config.tiers, ctx.num_engines)
        # virtual clock per engine: when its queue of routed prefill work drains (FIFO)
        self.busy_until = np.zeros(ctx.num_engines, dtype=np.float64)
        self.now = 0.0

    def scores(self, cands: np.ndarray, request: RequestView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(score seconds, predicted prefill seconds, matched blocks) per candidate; no side effects."""
        cl = [int(c) for c in cands]
        score, pred, matched = self._score_lists(cl, request)
        return np.asarray(score), np.asarray(pred), np.asarray(matched, dtype=np.int64)

    def _score_lists(
        self, cands: list[int], request: RequestView
    ) -> tuple[list[float], list[float], list[int]]:
        """The rule of the module docstring, in plain Python: pools have few engines and
        numpy's per-call overhead would dominate a decision."""
        all_matched = self.index.match_list(request.blocks)
        matched = [all_matched[c] for c in cands]
        n = request.input_len
        fetch_s = self.config.store_fetch_s_per_block
        remote = self.index.store_match(request.blocks) if fetch_s is not None else 0
        # (predicted seconds, seconds of compute) per distinct match length, and whether the
        # engine holds the request's directory slot (RequestView.cached_tokens): few distinct
        holders = request.swa_slot_holders
        keys = [(m, c in holders) for m, c in zip(matched, cands)]
        times = {k: self._prefill(request, k[0], remote, fetch_s or 0.0, c) for k, c in zip(keys, cands)}
        pred = [times[k][0] for k in keys]
        compute = [times[k][1] for k in keys]
        # rho weighs recomputed tokens only: a fetch uses the engine's link, not pool compute
        rho, cmin = self._rho(), min(compute)
        if self.config.wait_estimate == "outstanding":
            wait = [float(self.outstanding_work[c]) for c in cands]
        else:
            busy, now = self.busy_until.tolist(), self.now
            wait = [busy[c] - now if busy[c] > now else 0.0 for c in cands]
        # recomputing what another engine holds costs the pool capacity, not just this request
        if self.config.use_tiers:
            mask = self.planner.serving_list(self.planner.tier_of(n))
            factor = 1.0 + self.config.cross_tier_factor
            score = [
                (w + p + rho * (c - cmin)) * (1.0 if mask[e] else factor)
                for w, p, c, e in zip(wait, pred, compute, cands)
            ]
        else:
            score = [w + p + rho * (c - cmin) for w, p, c in zip(wait, pred, compute)]
        return score, pred, matched

    def _prefill(
        self, request: RequestView, matched: int, remote: int, fetch_s: float, engine: int | None = None
    ) -> tuple[float, float]:
        """(predicted seconds, compute seconds) of a prefill on ``engine`` with ``matched``
        blocks cached there and ``remote`` in the KV store, whose fetch costs ``fetch_s`` per
        block. A hit's window replay, or the fetch of its directory slot, is compute
        (``RequestView.cached_tokens``)."""
        cost, n = self.ctx.cost, request.input_len
        c = cost.prefill_time(n, request.cached_tokens(matched, engine))
        if remote > matched:  # the engine may fetch the store's longer prefix instead
            c_store = cost.prefill_time(n, request.cached_tokens(remote, engine))
            if c_store + (remote - matched) * fetch_s < c:
                return c_store + (remote - matched) * fetch_s, c_store
        return c, c

    def wait(self, cands: np.ndarray) -> np.ndarray:
        """Predicted seconds until each candidate has drained the work routed to it.

        Unlike the outstanding-work sum this does not count the elapsed part of the
        request an engine is running. Engine reports (``queued_work_s``) re-anchor it.
        """
        if self.config.wait_estimate == "outstanding":
            return self.outstanding_work[cands]
        return np.maximum(self.busy_until[cands] - self.now, 0.0)

    def update_loads(self, loads: Sequence[EngineLoad]) -> None:
        super().update_loads(loads)
        for load in loads:
            if load.queued_work_s is not None:
                self.busy_until[load.engine] = self.now + load.queued_work_s

    def _rho(self) -> float:
        cfg = self.config
        if cfg.recompute_gain <= 0:
            return cfg.recompute_weight
        return float(min(max(cfg.recompute_gain * self.outstanding.mean(), 1.0), cfg.recompute_weight))

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = list(map(int, candidates))
        if not cands:
            raise NoCandidates("no candidate engine to route to (empty pool or all engines excluded)")
        self.now = max(self.now, request.arrival_s)
        if self.config.use_tiers:
            self.planner.maybe_rebalance(request.arrival_s, self.outstanding_work)
        score, pred, matched = self._score_lists(cands, request)
        best = min(score)
        if score.count(best) == 1:
            pos = score.index(best)
        else:  # ties (idle engines, no hits): fewest requests in flight, then the lowest index
            running = self.outstanding.tolist()
            pos = min(range(len(cands)), key=lambda i: (score[i], running[cands[i]], cands[i]))
        e, work = cands[pos], pred[pos]
        self.planner.record(self.planner.tier_of(request.input_len), work)
        self.busy_until[e] = max(float(self.busy_until[e]), self.now) + work
        self.index.predict(e, request.blocks, known_held=matched[pos], now_s=self.now)
        return self._charge(e, request, request.input_len, work)


DECODE_RULES = ("weighted", "relative", "normalized", "step_time", "marginal")


@dataclass(frozen=True)
class TwoDimConfig:
    rule: str = "weighted"  # see DECODE_RULES and the module docstring
    ema_alpha: float = 0.05  # "normalized" only: weight of each new request in L_ref
    initial_len_ref: float = 8192.0  # "normalized" only

    def __post_init__(self) -> None:
        if self.rule not in DECODE_RULES:
            raise ValueError(f"rule must be one of {DECODE_RULES}, got {self.rule!r}")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.initial_len_ref <= 0:
            raise ValueError(f"initial_len_ref must be > 0, got {self.initial_len_ref}")


@DECODE_POLICIES.register("sluice")
class TwoDimDecode(Policy):
    """The 2D decode balancer over (running requests, KV tokens); formula in the module doc."""

    name = "sluice"

    def __init__(self, ctx: PolicyContext, config: TwoDimConfig | None = None) -> None:
        super().__init__(ctx)
        self.config = config or TwoDimConfig()
        self.len_ref = self.config.initial_len_ref
        self.kv_capacity = np.full(ctx.num_engines, np.inf)

    def update_loads(self, loads: Sequence[EngineLoad]) -> None:
        super().update_loads(loads)
        for load in loads:
            if load.kv_tokens is not None:
                self.outstanding_tokens[load.engine] = load.kv_tokens
            if load.kv_capacity is not None:
                self.kv_capacity[load.engine] = load.kv_capacity

    def scores(self, cands: np.ndarray, context_len: int) -> np.ndarray:
        r = self.outstanding[cands].astype(np.float64)
        k = self.outstanding_tokens[cands]
        m = self.ctx.decode_cost
        if self.config.rule in ("weighted", "relative", "normalized"):
            if self.config.rule == "weighted":  # the request's share of step time due to its KV
                w = m.d2 * context_len / (m.d1 + m.d2 * context_len) if m.d1 + m.d2 > 0 else 0.5
            elif self.config.rule == "relative":  # its share of the pool's mean footprint
                per_req = (k.sum() + context_len) / (r.sum() + 1.0)
                w = context_len / (context_len + per_req)
            else:
                w = context_len / (context_len + self.len_ref)
            r_ref = r.mean() + 1.0
            k_ref = k.mean() + context_len
            return (1.0 - w) * (r + 1.0) / r_ref + w * (k + context_len) / k_ref
        after = m.d0 + m.d1 * (r + 1.0) + m.d2 * (k + context_len)  # predicted step seconds
        if self.config.rule == "marginal":  # + what it adds to each step of the r already there
            return after + r * (m.d1 + m.d2 * context_len)
        return after

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = candidates_array(candidates)
        ctx_len = request.input_len
        fits = self.outstanding_tokens[cands] + ctx_len <= self.kv_capacity[cands]
        if fits.any():
            cands = cands[fits]
        score = self.scores(cands, ctx_len)
        running = self.outstanding[cands].astype(np.float64)
        # ties (e.g. idle engines): fewest requests, then the lowest index
        e = int(min(zip(score.tolist(), running.tolist(), cands.tolist()))[2])
        a = self.config.ema_alpha
        self.len_ref = (1 - a) * self.len_ref + a * ctx_len
        return self._charge(e, request, ctx_len)


@dataclass(frozen=True)
class VisionRequest:
    request_id: str
    image_tokens: int


class LeastOutstandingWork:
    """Vision-encoder balancing: the instance with the fewest image tokens in flight.

    ``select`` charges the request's image tokens to the chosen instance; ``on_complete``
    releases them. Ties go to the lowest index.
    """

    def __init__(self, num_instances: int) -> None:
        if num_instances < 1:
            raise ValueError(f"LeastOutstandingWork needs >= 1 instance, got {num_instances}")
        self.work = np.zeros(num_instances, dtype=np.float64)
        self._charged: dict[str, tuple[int, int]] = {}

    def select(self, candidates: Sequence[int], request: VisionRequest) -> int:
        cands = candidates_array(candidates)
        e = argmin_tiebreak(self.work[cands], cands)
        self.work[e] += request.image_tokens
        self._charged[request.request_id] = (e, request.image_tokens)
        return e

    def on_complete(self, instance: int, request: VisionRequest) -> None:
        charged = self._charged.pop(request.request_id, None)
        if charged is not None:
            self.work[charged[0]] = max(self.work[charged[0]] - charged[1], 0.0)
