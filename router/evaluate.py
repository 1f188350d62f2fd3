"""Run router policies over a trace in the simulator and score them against references.

Definitions (also in docs/router.md):

* ``hit_rate``: cached input tokens / input tokens. ``hit_rate_inf``: the same for an
  infinite cache shared by every engine (a block hits if any earlier request had it).
* **Online run**: arrivals keep the trace's shape, time-scaled so the *reference* prefill
  work fills ``load`` of the pool: ``scale = W_ref / (N * load * span)``. TTFT/TPOT
  percentiles come from it.
* **Offline run**: the same, scaled to ``offline_load`` (> 1, overloaded), so the pool is
  work-bound and the makespan measures cache loss plus imbalance.
* ``W_ref``: total prefill seconds with every infinite-cache hit taken (least possible
  work). The perfectly balanced offline reference finishes at ``T_ref = W_ref / N``.
* ``throughput`` (prefill, tokens/s) = input tokens / prefill makespan of the offline run;
  ``ratio_to_reference = T_ref / makespan`` = throughput / reference throughput.
* **Decode stress** (``decode_stress``): prefill made free, arrivals offering
  ``utilization`` of the pool's peak decode throughput; the engines step at
  ``SimConfig.decode_step`` (the measured ``StepTable``) while routers score with their
  own ``DecodeCostModel``, and ``grade_decode`` grades balance from samples of every
  engine's (running sequences, KV tokens) on a uniform time grid: per engine the time
  average of running sequences, of KV tokens and of the table's step time; balance =
  max / mean over engines.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from costmodel import CostModel
from router import cache_aware, sluice  # noqa: F401  (registers policies)
from router.policy import DECODE_POLICIES, PREFILL_POLICIES, Policy, PolicyContext, RequestView
from router.prefix_index import PrefixIndex, PrefixIndexConfig
from router.sim import SimConfig, SimResult, Simulator, StepTimeModel
from router.steptable import StepTable
from router.trace import Trace, infinite_cache_blocks, reference_work

POLICY_NAMES = ("round_robin", "least_load", "cache_aware", "sluice")
Builder = Callable[[SimConfig], tuple[Policy, Policy, PrefixIndex]]


@dataclass(frozen=True)
class Reference:
    work_s: float  # W_ref
    hit_rate_inf: float
    span_s: float  # trace arrival span, unscaled
    num_prefill: int

    @property
    def balanced_makespan_s(self) -> float:
        return self.work_s / self.num_prefill

    def time_scale(self, load: float) -> float:
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        return self.balanced_makespan_s / (load * max(self.span_s, 1e-9))


def reference(trace: Trace, cfg: SimConfig) -> Reference:
    inf = infinite_cache_blocks(trace)
    hits = np.minimum(inf * trace.block_size, trace.input_len)
    return Reference(
        float(reference_work(trace, cfg.cost).sum()),
        float(hits.sum() / trace.input_len.sum()),
        float(trace.arrival_s[-1] - trace.arrival_s[0]),
        cfg.num_prefill,
    )


def build(name: str, cfg: SimConfig) -> tuple[Policy, Policy, PrefixIndex]:
    """The (prefill, decode) policy pair for ``name`` and the global index they share."""
    index = PrefixIndex(PrefixIndexConfig(cfg.num_prefill))
    pctx = PolicyContext(cfg.num_prefill, index=index, cost=cfg.cost, decode_cost=cfg.decode_cost)
    dctx = PolicyContext(cfg.num_decode, cost=cfg.cost, decode_cost=cfg.decode_cost)
    if name == "cache_aware":
        pre: Policy = cache_aware.CacheAware(
            pctx, cache_aware.CacheAwareConfig(max_tree_blocks=cfg.cache_blocks)
        )
    elif name == "sluice" and cfg.store_blocks:  # the store's directory feeds the index
        pre = sluice.SluicePrefill(
            pctx, sluice.SluicePrefillConfig(store_fetch_s_per_block=cfg.store_fetch_s_per_block)
        )
    else:
        pre = PREFILL_POLICIES.create(name, pctx)
    return pre, DECODE_POLICIES.create(name, dctx), index


def simulate(
    trace: Trace, prefill: Policy, decode: Policy, index: PrefixIndex, cfg: SimConfig, scale: float
) -> tuple[SimResult, float]:
    t0 = time.perf_counter()
    res = Simulator(trace, prefill, decode, cfg, index=index, time_scale=scale).run()
    return res, time.perf_counter() - t0


def balance(x: np.ndarray) -> float:
    """max / mean over engines (1.0 is perfectly even), DeepSeek's imbalance measure."""
    m = float(np.mean(x))
    return float(np.max(x) / m) if m > 0 else 1.0


def score(trace: Trace, ref: Reference, online: SimResult, offline: SimResult | None) -> dict[str, Any]:
    hit = float(online.cached_tokens.sum() / trace.input_len.sum())
    store_share = float(online.store_tokens.sum() / max(online.cached_tokens.sum(), 1))
    tpot = online.tpot_s[np.isfinite(online.tpot_s)]
    out: dict[str, Any] = {
        "hit_rate": hit,
        "hit_rate / hit_rate_inf": hit / ref.hit_rate_inf if ref.hit_rate_inf > 0 else 1.0,
        "store_share_of_hits": store_share,
        "ttft_p50_s": float(np.percentile(online.ttft_s, 50)),
        "ttft_p99_s": float(np.percentile(online.ttft_s, 99)),
        "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3) if len(tpot) else 0.0,
        "tpot_p99_ms": float(np.percentile(tpot, 99) * 1e3) if len(tpot) else 0.0,
        "prefill_balance_max_over_mean": balance(online.prefill_busy_s),
        "decode_kv_balance_max_over_mean": balance(online.decode_kv_area),
        "decode_req_balance_max_over_mean": balance(online.decode_req_area),
    }
    if offline is not None:
        total_in = float(trace.input_len.sum())
        out["throughput_tok_s"] = total_in / offline.prefill_makespan_s
        out["reference_throughput_tok_s"] = total_in / ref.balanced_makespan_s
        out["throughput / reference_throughput"] = ref.balanced_makespan_s / offline.prefill_makespan_s
        out["offline_hit_rate"] = float(offline.cached_tokens.sum() / total_in)
    return out


def evaluate(
    trace: Trace,
    cfg: SimConfig,
    policies: tuple[str, ...] = POLICY_NAMES,
    load: float = 0.7,
    offline_load: float = 1.5,
    extra: dict[str, Builder] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Reference, dict[str, dict[str, Any]]]:
    """Score each policy (and each ``extra`` builder) with one online and one offline run."""
    ref = reference(trace, cfg)
    builders: dict[str, Builder] = {name: functools.partial(build, name) for name in policies}
    builders.update(extra or {})
    results: dict[str, dict[str, Any]] = {}
    for name, make in builders.items():
        online, t_on = simulate(trace, *make(cfg), cfg, ref.time_scale(load))
        offline, t_off = simulate(trace, *make(cfg), cfg, ref.time_scale(offline_load))
        results[name] = score(trace, ref, online, offline) | {"sim_wall_s": t_on + t_off}
        if progress:
            progress(f"{trace.name} {name}: {results[name]}")
    return ref, results


class Replay(Policy):
    """Replays choices another router made (e.g. the SGLang router over HTTP), by request id.

    Raises ValueError for a request without a recorded choice or a choice outside
    ``candidates``: a replay must never silently substitute its own decision.
    """

    name = "replay"

    def __init__(self, ctx: PolicyContext, choices: dict[int, int]) -> None:
        super().__init__(ctx)
        self.choices = choices

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        e = self.choices.get(int(request.request_id))  # type: ignore[call-overload]
        if e is None or e not in candidates:
            raise ValueError(f"replay has no valid choice for request {request.request_id!r} (got {e!r})")
        return self._charge(e, request, request.input_len)


def replay_builder(prefill_choices: dict[int, int], decode_choices: dict[int, int]) -> Builder:
    def make(cfg: SimConfig) -> tuple[Policy, Policy, PrefixIndex]:
        index = PrefixIndex(PrefixIndexConfig(cfg.num_prefill))
        return (
            Replay(PolicyContext(cfg.num_prefill, index=index), prefill_choices),
            Replay(PolicyContext(cfg.num_decode), decode_choices),
            index,
        )

    return make


def grade_decode(running: np.ndarray, kv_tokens: np.ndarray, table: StepTimeModel) -> dict[str, float]:
    """Balance of decode engines from samples ``[S, M]`` taken on a uniform time grid.

    Only samples where some engine runs a sequence count (the pool's busy window). Per
    engine: the time average of running sequences, of KV tokens, and of step time (the
    table at that engine's (running, KV) at each sample; an engine with nothing running
    takes no step: 0). Each balance is max / mean of those averages over engines.
    ``step_instant_max_over_mean`` is the time average of max / mean step time over
    engines at each sample: how much slower the slowest engine stepped than the mean, at
    the same instant.
    """
    r = np.asarray(running, dtype=np.float64)
    k = np.asarray(kv_tokens, dtype=np.float64)
    busy = r.sum(axis=1) > 0
    r, k = r[busy], k[busy]
    if not len(r):
        return {"running_max_over_mean": 1.0, "kv_max_over_mean": 1.0, "step_max_over_mean": 1.0,
                "step_instant_max_over_mean": 1.0, "step_mean_ms": 0.0}  # fmt: skip
    if isinstance(table, StepTable):
        step = table.step_times(r, k)
    else:
        step = np.array([[table.step_time(int(b), kv) if b > 0 else 0.0 for b, kv in zip(rb, rk)]
                         for rb, rk in zip(r, k)])  # fmt: skip
    inst = step.max(axis=1) / step.mean(axis=1)
    return {
        "running_max_over_mean": balance(r.mean(axis=0)),
        "kv_max_over_mean": balance(k.mean(axis=0)),
        "step_max_over_mean": balance(step.mean(axis=0)),
        "step_instant_max_over_mean": float(inst.mean()),
        "step_mean_ms": float(step[r > 0].mean() * 1e3),
    }


def peak_decode_throughput(trace: Trace, cfg: SimConfig, step: StepTimeModel) -> tuple[float, int]:
    """(tokens/s, sequences) at the best batch size of one decode engine stepping at ``step``,
    with every sequence at the trace's mean context (input + half the output), within the
    engine's batch and KV limits."""
    mean_ctx = float(trace.input_len.mean() + trace.output_len.mean() / 2)
    top = max(1, min(cfg.decode_max_batch, int(cfg.decode_kv_capacity // max(mean_ctx, 1.0))))
    return max((n / step.step_time(n, n * mean_ctx), n) for n in range(1, top + 1))


def decode_stress(
    trace: Trace,
    cfg: SimConfig,
    policies: tuple[str, ...] = POLICY_NAMES,
    utilization: float = 0.75,
    samples: int = 2000,
    extra: dict[str, Callable[[PolicyContext], Policy]] | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Decode balancers alone: prefill made ~free, arrivals scaled so the decode tokens
    they bring are ``utilization`` of the pool's peak decode throughput
    (``peak_decode_throughput`` on the engines' step time: ``cfg.decode_step`` when set,
    else ``cfg.decode_cost``). How many sequences an engine then runs is an outcome.

    Returns the load it ran at and, per policy, TPOT percentiles (the engines' step
    times), the decode queue wait (join to admission, p99) and ``grade_decode``'s balances
    from ``samples`` samples over the run; prefill policies are irrelevant here.
    ``extra``: more decode policies by name (e.g. ablations).
    """
    if utilization <= 0:
        raise ValueError(f"utilization must be > 0, got {utilization}")
    truth: StepTimeModel = cfg.decode_step or cfg.decode_cost
    peak, at_batch = peak_decode_throughput(trace, cfg, truth)
    span = max(float(trace.arrival_s[-1] - trace.arrival_s[0]), 1e-9)
    decode_tokens = float(np.maximum(trace.output_len - 1, 0).sum())
    scale = decode_tokens / (utilization * peak * cfg.num_decode * span)
    t_dec = float(trace.output_len.mean()) * truth.step_time(
        at_batch, at_batch * float(trace.input_len.mean())
    )
    dcfg = dataclasses.replace(
        cfg,
        cost=CostModel(a=0.0, b=1e-12, c=0.0, d=0.0),
        sample_interval_s=(span * scale + t_dec) / samples,
    )
    out: dict[str, dict[str, float]] = {}
    for name in (*policies, *(extra or {})):
        if name in policies:
            pre, dec, idx = build(name, dcfg)
        else:  # an extra decode policy behind round robin prefill
            pre, _, idx = build("round_robin", dcfg)
            dec = (extra or {})[name](
                PolicyContext(dcfg.num_decode, cost=dcfg.cost, decode_cost=dcfg.decode_cost)
            )
        res, wall = simulate(trace, PREFILL_POLICIES.create("round_robin", pre.ctx), dec, idx, dcfg, scale)
        tpot = res.tpot_s[np.isfinite(res.tpot_s)] * 1e3
        busy = res.sample_running.sum(axis=1) > 0
        out[name] = {
            "tpot_p50_ms": float(np.percentile(tpot, 50)),
            "tpot_p99_ms": float(np.percentile(tpot, 99)),
            **grade_decode(res.sample_running, res.sample_kv, truth),
            "decode_wait_p99_s": float(np.percentile(res.decode_wait_s, 99)),
            "running_per_engine_mean": float(res.sample_running[busy].mean()) if busy.any() else 0.0,
            "decode_makespan_s": res.makespan_s,
            "sim_wall_s": wall,
        }
    load = {"utilization": utilization, "peak_tok_s_per_engine": peak, "peak_at_batch": at_batch,
            "time_scale": scale}  # fmt: skip
    return load, out
