"""Step-driven simulator: disaggregated (prefill pool + decode pool) vs colocated serving.

Pure (numpy, stdlib, ``costmodel`` and ``router``): ``sluice bench e2e`` runs it at
DeepSeek's scale (``services/bench/_e2e_sim.py`` builds the step model and sweeps).

**Engines step.** Every engine runs one forward step at a time; a step's time is
``StepModel.step_time`` of what it holds::

    t = c + d * (new prefill tokens) + a * sum_i C_i * (C_i + H_i) + b * sum_i (C_i + H_i)
          + d1 * B + d2 * K

with prefill pieces (``C_i`` new tokens after ``H_i`` already in the sequence's cache) and
a decode batch of ``B`` sequences holding ``K`` KV tokens. ``c`` (the fixed per-step
cost) is paid once per step whatever the step holds. A request's first token is sampled
at the end of the step that computes its last prompt token (TTFT); each decode step gives
every sequence in the batch one token.

* **Disaggregated**: ``num_prefill`` prefill engines take up to ``prefill_budget`` new
  tokens per step from their FIFO queue (several requests per step, the last one possibly
  partial); no decode. When a prefill ends, the decode policy picks a decode engine and
  the sequence arrives there ``handoff_s(prompt tokens)`` later (cache bytes over link
  bandwidth); it joins the next step. ``num_decode`` decode engines run decode-only steps
  of at most ``max_batch`` sequences (the rest wait FIFO).
* **Colocated**: ``num_colocated`` engines; each step holds the engine's whole decode
  batch plus up to ``prefill_budget`` new prefill tokens from its queue (the budget counts
  prefill tokens only; decode tokens ride along). A finished prefill joins the same
  engine's decode batch at the next step.

**Routing.** The prefill policy (e.g. ``sluice``) picks the engine at arrival, with the
shared ``PrefixIndex`` kept up to date by stored/removed events. Each engine keeps an LRU
prefix cache of ``cache_blocks`` blocks (``router.sim.PrefillEngineState``); the cached
prefix is looked up when the request's prefill starts and the blocks enter the cache when
it ends. The decode policy (disaggregated only, e.g. ``TwoDimDecode``) sees its own
select/complete bookkeeping. Colocated decode stays on the prefill engine.

**Per request**: TTFT = first token - arrival; TPOT = (last token - first token) /
(output - 1): the handoff and the wait for a decode slot are inside it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from costmodel import CostModel, DecodeCostModel
from router.policy import Policy, RequestView
from router.prefix_index import PrefixIndex
from router.sim import PrefillEngineState
from router.trace import Trace, cached_tokens, infinite_cache_blocks

_ARRIVAL, _STEP_END, _HANDOFF = 0, 1, 2


@dataclass(frozen=True)
class StepModel:
    """Seconds per engine step (module docstring). Every coefficient >= 0."""

    c: float  # fixed per step
    d: float  # per new prefill token
    a: float = 0.0  # per (new token, context token) pair of a prefill piece
    b: float = 0.0  # per context token of a prefill piece
    d1: float = 0.0  # per decode sequence in the step
    d2: float = 0.0  # per KV token the decode batch holds

    def __post_init__(self) -> None:
        for name in ("c", "d", "a", "b", "d1", "d2"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"StepModel.{name} must be a finite number >= 0, got {v!r}")
        if self.c == 0 and self.d == 0:
            raise ValueError("StepModel needs c or d > 0")

    def piece(self, chunk: int, history: int) -> float:
        """Variable seconds of one prefill piece (no fixed cost)."""
        return self.a * chunk * (chunk + history) + self.b * (chunk + history) + self.d * chunk

    def step_time(self, pieces: Sequence[tuple[int, int]], batch: int, kv_tokens: float) -> float:
        return self.c + sum(self.piece(cn, h) for cn, h in pieces) + self.d1 * batch + self.d2 * kv_tokens

    def decode_step(self, batch: int, kv_tokens: float) -> float:
        return self.step_time((), batch, kv_tokens)

    def cost_model(self, chunk_budget: int) -> CostModel:
        """The same prefill times as a ``CostModel`` (for the routing policies)."""
        return CostModel(a=self.a, b=self.b, c=self.c, d=self.d, chunk_budget=chunk_budget)

    def decode_cost_model(self) -> DecodeCostModel:
        return DecodeCostModel(d0=self.c, d1=self.d1, d2=self.d2)


@dataclass(frozen=True)
class PDConfig:
    mode: str  # "disaggregated" or "colocated"
    step: StepModel
    num_prefill: int = 64  # disaggregated
    num_decode: int = 64  # disaggregated
    num_colocated: int = 128  # colocated
    prefill_budget: int = 32_768  # new prefill tokens per step
    max_batch: int = 256  # decode sequences per engine step
    kv_capacity: float = math.inf  # KV tokens of running decode sequences per engine
    cache_blocks: int = 32_768  # prefix-cache blocks per engine (LRU)
    handoff_bytes_per_token: float = 0.0
    handoff_fixed_bytes: float = 0.0  # per sequence (its window slot)
    link_bytes_per_s: float = math.inf  # per prefill -> decode transfer

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"PDConfig.mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        for name in (
            "num_prefill",
            "num_decode",
            "num_colocated",
            "prefill_budget",
            "max_batch",
            "cache_blocks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"PDConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.link_bytes_per_s <= 0 or self.kv_capacity <= 0:
            raise ValueError("PDConfig.link_bytes_per_s and kv_capacity must be > 0")

    def handoff_s(self, tokens: int) -> float:
        if self.mode != "disaggregated":
            return 0.0
        return (self.handoff_bytes_per_token * tokens + self.handoff_fixed_bytes) / self.link_bytes_per_s


@dataclass
class PDResult:
    ttft_s: np.ndarray  # [R]
    tpot_s: np.ndarray  # [R] NaN when output <= 1
    cached_tokens: np.ndarray  # [R]
    handoff_s: np.ndarray  # [R] 0 when colocated
    prefill_engine: np.ndarray  # [R]
    decode_engine: np.ndarray  # [R] (= prefill engine when colocated)
    steps: int  # engine steps simulated, all engines
    makespan_s: float


class _Engine:
    """One engine's queues and running decode batch."""

    def __init__(self, cache_blocks: int) -> None:
        self.cache = PrefillEngineState(cache_blocks)
        self.queue: deque[list[int]] = deque()  # [request, next token, end token] of prefills
        self.waiting: deque[int] = deque()  # decode sequences waiting for a slot
        self.heap: list[tuple[int, int]] = []  # (step count at which it finishes, request)
        self.running: set[int] = set()
        self.kv = 0.0  # KV tokens of running decode sequences
        self.count = 0  # decode steps completed
        self.busy = False
        self.step_pieces: list[tuple[int, int, int]] = []  # (request, start, end) computed this step
        # a run of identical decode-only steps: start time, step seconds, steps; its end event's version
        self.run_start, self.run_dt, self.run_steps, self.version = 0.0, 0.0, 1, 0


class PDSimulator:
    def __init__(
        self,
        trace: Trace,
        config: PDConfig,
        prefill: Policy,
        decode: Policy | None = None,
        index: PrefixIndex | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if config.mode == "disaggregated" and decode is None:
            raise ValueError("the disaggregated mode needs a decode policy")
        self.trace, self.cfg, self.prefill, self.decode, self.index = trace, config, prefill, decode, index
        self.arrival = np.asarray(trace.arrival_s, dtype=np.float64) * time_scale
        r = len(trace)
        self.input_len = [int(x) for x in trace.input_len]
        self.output_len = [int(x) for x in trace.output_len]
        self.views = [
            RequestView(i, self.input_len[i], trace.blocks[i], float(self.arrival[i]), 0, trace.block_size)
            for i in range(r)
        ]
        colocated = config.mode == "colocated"
        n_pre = config.num_colocated if colocated else config.num_prefill
        self.pre = [_Engine(config.cache_blocks) for _ in range(n_pre)]
        self.dec = self.pre if colocated else [_Engine(1) for _ in range(config.num_decode)]
        self._pre_all = list(range(n_pre))
        self._dec_all = list(range(config.num_decode))
        self._events: list[tuple[float, int, int, int, int, int]] = []
        self._seq = 0
        nan = np.full(r, np.nan)
        self.res = PDResult(
            nan.copy(), nan.copy(), np.zeros(r, dtype=np.int64), np.zeros(r),
            np.full(r, -1), np.full(r, -1), 0, 0.0,
        )  # fmt: skip
        self._first = np.full(r, np.nan)

    def _push(self, t: float, kind: int, a: int, b: int = 0, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b, version))

    def run(self) -> PDResult:
        for i in range(len(self.trace)):
            self._push(float(self.arrival[i]), _ARRIVAL, i)
        while self._events:
            t, _, kind, a, b, version = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._on_arrival(t, a)
            elif kind == _STEP_END:
                self._on_step_end(t, a, b, version)
            else:
                self._on_handoff(t, a, b)
        return self.res

    # -- routing ------------------------------------------------------------------------
    def _on_arrival(self, t: float, i: int) -> None:
        e = self.prefill.select(self._pre_all, self.views[i])
        self.res.prefill_engine[i] = e
        self.pre[e].queue.append([i, -1, self.input_len[i]])
        self._kick(t, self.pre, 0, e)

    def _on_handoff(self, t: float, d: int, i: int) -> None:
        self.dec[d].waiting.append(i)
        self._kick(t, self.dec, 1, d)

    # -- steps --------------------------------------------------------------------------
    def _kick(self, t: float, pool: list[_Engine], which: int, e: int) -> None:
        """New work for engine ``e``: start a step when idle; when it is in a run of identical
        decode steps, end the run with the step in progress (the work joins the next step)."""
        eng = pool[e]
        if not eng.busy:
            self._start_step(t, pool, which, e)
            return
        if eng.run_steps > 1:
            done = int((t - eng.run_start) / eng.run_dt)  # steps of the run finished by t
            steps = min(done + 1, eng.run_steps)
            if steps < eng.run_steps:
                eng.run_steps = steps
                eng.version += 1
                self._push(eng.run_start + steps * eng.run_dt, _STEP_END, which, e, eng.version)

    def _admit(self, eng: _Engine) -> None:
        cfg = self.cfg
        while eng.waiting:
            i = eng.waiting[0]
            full = len(eng.running) >= cfg.max_batch or eng.kv + self.input_len[i] > cfg.kv_capacity
            if full and eng.running:
                return
            eng.waiting.popleft()
            eng.running.add(i)
            eng.kv += self.input_len[i]
            heapq.heappush(eng.heap, (eng.count + self.output_len[i] - 1, i))

    def _start_step(self, t: float, pool: list[_Engine], which: int, e: int) -> None:
        eng, cfg = pool[e], self.cfg
        has_decode = which == 1 or cfg.mode == "colocated"
        has_prefill = which == 0
        if has_decode:
            self._admit(eng)
        pieces: list[tuple[int, int]] = []
        eng.step_pieces = []
        if has_prefill:
            room = cfg.prefill_budget
            for item in eng.queue:
                if room <= 0:
                    break
                i, start, end = item
                if start < 0:  # the prefill starts: look up the engine's cached prefix
                    view = self.views[i]
                    cached = view.cached_tokens(eng.cache.lookup(view.blocks))
                    start = min(cached, end - 1)  # the last token is always computed
                    self.res.cached_tokens[i] = start
                    item[1] = start
                n = min(room, end - start)
                pieces.append((n, start))
                eng.step_pieces.append((i, start, start + n))
                room -= n
        batch = len(eng.running) if has_decode else 0
        if not pieces and not batch:
            eng.busy = False
            return
        eng.busy = True
        dt = cfg.step.step_time(pieces, batch, eng.kv if batch else 0.0)
        # decode-only: the same step repeats until a sequence finishes or new work arrives
        steps = max(eng.heap[0][0] - eng.count, 1) if not pieces and eng.heap else 1
        eng.run_start, eng.run_dt, eng.run_steps = t, dt, steps
        eng.version += 1
        self._push(t + steps * dt, _STEP_END, which, e, eng.version)

    def _on_step_end(self, t: float, which: int, e: int, version: int) -> None:
        pool = self.pre if which == 0 else self.dec
        eng, cfg = pool[e], self.cfg
        if version != eng.version:
            return  # a run cut short: its end moved
        self.res.steps += eng.run_steps
        colocated = cfg.mode == "colocated"
        if which == 1 or colocated:  # every running sequence got one token per step
            if eng.running:
                eng.count += eng.run_steps
            while eng.heap and eng.heap[0][0] <= eng.count:
                _, i = heapq.heappop(eng.heap)
                eng.running.discard(i)
                eng.kv -= self.input_len[i]
                self.res.tpot_s[i] = (t - self._first[i]) / (self.output_len[i] - 1)
                self._done(t)
                if self.decode is not None and not colocated:
                    self.decode.on_complete(e, self.views[i])
        if which == 0:
            for i, _start, stop in eng.step_pieces:
                item = eng.queue[0] if eng.queue and eng.queue[0][0] == i else None
                if stop < self.input_len[i]:
                    if item is not None:
                        item[1] = stop
                    continue
                if item is not None:
                    eng.queue.popleft()
                self._prefill_done(t, e, i)
            eng.step_pieces = []
        self._start_step(t, pool, which, e)

    def _prefill_done(self, t: float, e: int, i: int) -> None:
        view = self.views[i]
        eng = self.pre[e]
        evicted = eng.cache.insert(view.blocks)
        if self.index is not None:
            self.index.apply_stored(e, view.blocks)
            if evicted:
                self.index.apply_removed(e, evicted)
        self.prefill.on_complete(e, view)
        self.res.ttft_s[i] = t - self.arrival[i]
        self._first[i] = t
        if self.output_len[i] <= 1:
            self._done(t)
            return
        if self.cfg.mode == "colocated":
            self.res.decode_engine[i] = e
            eng.waiting.append(i)  # joins this engine's batch at its next step
            return
        assert self.decode is not None
        d = self.decode.select(self._dec_all, view)
        self.res.decode_engine[i] = d
        h = self.cfg.handoff_s(self.input_len[i])
        self.res.handoff_s[i] = h
        self._push(t + h, _HANDOFF, d, i)

    def _done(self, t: float) -> None:
        self.res.makespan_s = max(self.res.makespan_s, t - float(self.arrival[0]))


# ------------------------------------------------------------------ goodput
@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, res: PDResult, output_len: np.ndarray) -> np.ndarray:
        """[R] bool: TTFT and TPOT both within the SLO (TPOT counts only for outputs > 1)."""
        tpot_ok = np.where(np.asarray(output_len) > 1, res.tpot_s <= self.tpot_s, True)
        return np.asarray((res.ttft_s <= self.ttft_s) & tpot_ok)


def feasible(trace: Trace, cost: CostModel, slo: SLO, decode_step_s: float) -> np.ndarray:
    """[R] bool: requests that could meet ``slo`` at all: on an idle engine, with every prefix
    hit an infinite cache shared by all engines would give, the prefill (``cost``) fits the
    TTFT and a decode step of one sequence (``decode_step_s``) fits the TPOT."""
    hits = cached_tokens(trace, infinite_cache_blocks(trace))
    t = np.array([cost.prefill_time(int(n), int(h)) for n, h in zip(trace.input_len, hits)])
    return np.asarray((t <= slo.ttft_s) & (decode_step_s <= slo.tpot_s))


def rate_of(trace: Trace, time_scale: float) -> float:
    """Offered requests per second of ``trace`` with its arrival times multiplied by ``time_scale``."""
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) * time_scale
    return len(trace) / span if span > 0 else math.inf


@dataclass
class SweepPoint:
    rate: float
    attainment: float  # share of all requests meeting both SLOs
    attainment_feasible: float  # share of the feasible requests meeting both SLOs
    slo_met_req_s: float  # rate * attainment
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    hit_rate: float
    steps: int


@dataclass
class SweepResult:
    points: list[SweepPoint] = field(default_factory=list)  # ascending rate

    def goodput_rate(self, level: float) -> float:
        """The offered rate (req/s) at which the share of feasible requests meeting both SLOs
        falls to ``level``: scanning up from the lowest rate, the first grid interval whose
        upper end is below ``level``, interpolated linearly in log(rate). The highest rate
        when none falls below; 0 when the lowest rate is already below."""
        pts = self.points
        if not pts or pts[0].attainment_feasible < level:
            return 0.0
        for lo, hi in zip(pts, pts[1:]):
            if hi.attainment_feasible < level:
                f = (lo.attainment_feasible - level) / (lo.attainment_feasible - hi.attainment_feasible)
                return math.exp(math.log(lo.rate) + f * (math.log(hi.rate) - math.log(lo.rate)))
        return pts[-1].rate

    def goodput(self, level: float) -> float:
        """Requests per second meeting both SLOs at ``goodput_rate(level)``: that rate times the
        share of all requests meeting both there (interpolated the same way)."""
        rate = self.goodput_rate(level)
        if rate <= 0:
            return 0.0
        xs = [math.log(p.rate) for p in self.points]
        share = float(np.interp(math.log(rate), xs, [p.attainment for p in self.points]))
        return rate * share


def sweep(
    trace: Trace,
    rates: Sequence[float],
    run_at: Callable[[float], PDResult],
    slo: SLO,
    ok_mask: np.ndarray,
    progress: Callable[[str], None] | None = None,
    label: str = "",
) -> SweepResult:
    """Run ``run_at(time_scale)`` at each offered rate of ``rates`` and score each run against
    ``slo``, over all requests and over ``ok_mask`` (the feasible ones)."""
    out = SweepResult()
    base = rate_of(trace, 1.0)
    n_ok = max(int(np.sum(ok_mask)), 1)
    for rate in sorted(rates):
        res = run_at(base / rate)
        met = slo.met(res, trace.output_len)
        tpot = res.tpot_s[np.isfinite(res.tpot_s)]
        p = SweepPoint(
            rate=rate,
            attainment=float(met.mean()),
            attainment_feasible=float(np.sum(met & ok_mask) / n_ok),
            slo_met_req_s=float(rate * met.mean()),
            ttft_p50_s=float(np.percentile(res.ttft_s, 50)),
            ttft_p99_s=float(np.percentile(res.ttft_s, 99)),
            tpot_p50_s=float(np.percentile(tpot, 50)) if len(tpot) else math.nan,
            tpot_p99_s=float(np.percentile(tpot, 99)) if len(tpot) else math.nan,
            hit_rate=float(res.cached_tokens.sum() / max(int(trace.input_len.sum()), 1)),
            steps=res.steps,
        )
        out.points.append(p)
        if progress:
            progress(
                f"{label} rate {rate:.2f} req/s: attainment {p.attainment:.3f} (feasible {p.attainment_feasible:.3f}), "
                f"TTFT p50 {p.ttft_p50_s:.2f} s, TPOT p50 {p.tpot_p50_s * 1e3:.0f} ms"
            )
    return out
