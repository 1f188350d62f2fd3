"""Event-driven trace simulator: N prefill and M decode engines driven by router policies.

Model (docs/router.md has the full statement):

* **Prefill engine**: FIFO, one request at a time, chunked by ``CostModel.chunk_budget``;
  duration ``cost.prefill_time(L, cached)``. ``cached`` is the longest prefix of the
  request's blocks in the engine's own LRU block cache (``cache_blocks`` capacity) when
  the prefill *starts*. On completion the request's blocks enter the LRU; the engine
  publishes ``stored`` and ``removed`` (eviction) events to the global prefix index.
* **Decode engine**: continuous batching as a fluid: every running sequence advances one
  token per step, step time ``decode_cost.step_time(B, K)`` re-evaluated at every join,
  leave and at least every ``max_step_gap_s``. At most ``decode_max_batch`` sequences and
  ``decode_kv_capacity`` KV tokens; others wait FIFO. Decode produces ``output_len - 1``
  tokens (the first comes from prefill).
* **Global KV store** (optional, ``store_blocks > 0``): one LRU over blocks behind every
  prefill engine; every computed block is written to it (``store_add`` to the index). A
  prefill fetches the store's longer prefix at ``store_fetch_s_per_block`` per block when
  that beats recomputing.
* **Router**: prefill policy at arrival, decode policy at prefill completion; both get
  ``on_complete``; decode engines report ``EngineLoad`` every ``stats_interval_s``.
* **Engine truth vs router model**: ``decode_step`` (e.g. a ``StepTable`` measured on the
  engine), when set, is what decode engines take per step; policies only ever see
  ``decode_cost``. Without it both are ``decode_cost``.
* **Samples** (``sample_interval_s`` set): every interval, each decode engine's running
  sequences and KV tokens, for grading balance afterwards (``router.evaluate.grade_decode``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from costmodel import CostModel, DecodeCostModel
from router.policy import EngineLoad, Policy, RequestView
from router.prefix_index import PrefixIndex
from router.trace import Trace

_ARRIVAL, _PREFILL_DONE, _DECODE_WAKE, _STATS, _SAMPLE = 0, 1, 2, 3, 4


class StepTimeModel(Protocol):
    def step_time(self, batch: int, kv_tokens: float) -> float: ...


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 8
    num_decode: int = 8
    cache_blocks: int = 32_768  # per prefill engine (16.8M tokens at 512 tokens per block)
    store_blocks: int = 0  # global KV store (LRU) behind every prefill engine; 0 = none
    store_fetch_s_per_block: float = 0.25e-3  # ~1.5 MB block at ~6 GB/s per GPU
    decode_max_batch: int = 256
    decode_kv_capacity: int = 8_000_000  # tokens per decode engine
    stats_interval_s: float = 0.5
    max_step_gap_s: float = 1.0
    cost: CostModel = field(default_factory=CostModel)
    decode_cost: DecodeCostModel = field(default_factory=DecodeCostModel)
    decode_step: StepTimeModel | None = None  # engine truth; None: decode_cost
    sample_interval_s: float | None = None  # record (running, KV) per decode engine

    def __post_init__(self) -> None:
        if self.sample_interval_s is not None and self.sample_interval_s <= 0:
            raise ValueError(f"SimConfig.sample_interval_s must be > 0 or None, got {self.sample_interval_s}")
        for name in ("num_prefill", "num_decode", "cache_blocks", "decode_max_batch", "decode_kv_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.store_blocks < 0 or self.store_fetch_s_per_block < 0:
            raise ValueError("SimConfig.store_blocks and store_fetch_s_per_block must be >= 0")
        if self.stats_interval_s <= 0 or self.max_step_gap_s <= 0:
            raise ValueError("SimConfig.stats_interval_s and max_step_gap_s must be > 0 seconds")


@dataclass
class SimResult:
    prefill_engine: np.ndarray  # [R] chosen prefill engine
    decode_engine: np.ndarray  # [R]
    cached_tokens: np.ndarray  # [R] tokens served from cache (local or store)
    store_tokens: np.ndarray  # [R] of which fetched from the global store
    ttft_s: np.ndarray  # [R]
    tpot_s: np.ndarray  # [R] NaN for requests with output_len <= 1
    prefill_busy_s: np.ndarray  # [N] seconds each prefill engine computed
    decode_kv_area: np.ndarray  # [M] integral of KV tokens over time
    decode_req_area: np.ndarray  # [M] integral of running sequences over time
    prefill_makespan_s: float
    makespan_s: float
    decode_wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [R] join -> admitted
    sample_t: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [S] seconds
    sample_running: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [S, M] sequences
    sample_kv: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [S, M] KV tokens


class PrefillEngineState:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[Hashable, None] = OrderedDict()
        self.queue: deque[int] = deque()
        self.busy = False

    # Recency is refreshed tail block first, so a prefix's root ends up most recent and
    # eviction takes leaves before the blocks they extend (vLLM frees blocks in reverse
    # order for the same reason): an evicted root would strand its whole chain.
    def lookup(self, blocks: Sequence[Hashable]) -> int:
        n = 0
        for b in blocks:
            if b not in self.lru:
                break
            n += 1
        for b in reversed(blocks[:n]):
            self.lru.move_to_end(b)
        return n

    def insert(self, blocks: Sequence[Hashable]) -> list[Hashable]:
        for b in reversed(blocks):
            if b in self.lru:
                self.lru.move_to_end(b)
            else:
                self.lru[b] = None
        evicted = []
        while len(self.lru) > self.capacity:
            evicted.append(self.lru.popitem(last=False)[0])
        return evicted


class _DecodeEngine:
    """Fluid continuous batching; V counts tokens produced per running sequence so far."""

    def __init__(self) -> None:
        self.v = 0.0
        self.last_t = 0.0
        self.step = 0.0
        self.sum_ctx = 0.0  # sum of context lengths at join
        self.sum_vjoin = 0.0
        self.heap: list[tuple[float, int]] = []  # (target V, request)
        self.vjoin: dict[int, float] = {}
        self.waiting: deque[int] = deque()
        self.version = 0
        self.kv_area = 0.0
        self.req_area = 0.0

    @property
    def batch(self) -> int:
        return len(self.vjoin)

    def kv(self) -> float:
        return self.sum_ctx + self.batch * self.v - self.sum_vjoin

    def advance(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0 and self.batch:
            self.kv_area += self.kv() * dt
            self.req_area += self.batch * dt
            self.v += dt / self.step
        self.last_t = t


class Simulator:
    def __init__(
        self,
        trace: Trace,
        prefill: Policy,
        decode: Policy,
        config: SimConfig,
        index: PrefixIndex | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.trace, self.prefill, self.decode, self.cfg, self.index = trace, prefill, decode, config, index
        self.arrival = trace.arrival_s * time_scale
        r = len(trace)
        self.views = [
            RequestView(
                i, int(trace.input_len[i]), trace.blocks[i], float(self.arrival[i]), 0, trace.block_size
            )
            for i in range(r)
        ]
        self.p_eng = [PrefillEngineState(config.cache_blocks) for _ in range(config.num_prefill)]
        self.store = PrefillEngineState(config.store_blocks) if config.store_blocks else None
        self.d_eng = [_DecodeEngine() for _ in range(config.num_decode)]
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        nan = np.full(r, np.nan)
        self.res = SimResult(
            np.full(r, -1), np.full(r, -1), np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64),
            nan.copy(), nan.copy(),
            np.zeros(config.num_prefill), np.zeros(config.num_decode), np.zeros(config.num_decode), 0.0, 0.0,
        )  # fmt: skip
        self._prefill_all = list(range(config.num_prefill))
        self._decode_all = list(range(config.num_decode))
        self._decode_start = np.zeros(r)
        self._decode_join_t = np.zeros(r)
        self._pending = r
        self._step_model: StepTimeModel = config.decode_step or config.decode_cost
        self._samples: list[tuple[float, list[int], list[float]]] = []

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def run(self) -> SimResult:
        r = len(self.trace)
        for i in range(r):
            self._push(float(self.arrival[i]), _ARRIVAL, i)
        self._push(float(self.arrival[0]), _STATS, 0)
        if self.cfg.sample_interval_s is not None:
            self._push(float(self.arrival[0]), _SAMPLE, 0)
        handlers = {
            _ARRIVAL: self._on_arrival,
            _PREFILL_DONE: self._on_prefill_done,
            _DECODE_WAKE: self._on_decode_wake,
            _STATS: self._on_stats,
            _SAMPLE: self._on_sample,
        }
        while self._events:
            t, _, kind, a, b = heapq.heappop(self._events)
            handlers[kind](t, a, b)
        res = self.res
        res.decode_kv_area[:] = [e.kv_area for e in self.d_eng]
        res.decode_req_area[:] = [e.req_area for e in self.d_eng]
        res.prefill_makespan_s = float(np.nanmax(self.arrival + res.ttft_s) - self.arrival[0])
        res.decode_wait_s = self._decode_start - self._decode_join_t
        m = self.cfg.num_decode
        res.sample_t = np.array([s[0] for s in self._samples])
        res.sample_running = np.array([s[1] for s in self._samples], dtype=np.int64).reshape(-1, m)
        res.sample_kv = np.array([s[2] for s in self._samples], dtype=np.float64).reshape(-1, m)
        return res

    # -- prefill ------------------------------------------------------------------------
    def _on_arrival(self, t: float, i: int, _: int) -> None:
        e = self.prefill.select(self._prefill_all, self.views[i])
        self.res.prefill_engine[i] = e
        eng = self.p_eng[e]
        eng.queue.append(i)
        if not eng.busy:
            self._start_prefill(t, e)

    def _start_prefill(self, t: float, e: int) -> None:
        eng = self.p_eng[e]
        i = eng.queue.popleft()
        view = self.views[i]
        local = eng.lookup(view.blocks)
        cost = self.cfg.cost
        dur = cost.prefill_time(view.input_len, view.cached_tokens(local))
        cached = view.cached_tokens(local)
        if self.store is not None:  # fetch the store's longer prefix when that is cheaper
            remote = self.store.lookup(view.blocks)
            fetch = (remote - local) * self.cfg.store_fetch_s_per_block
            with_store = cost.prefill_time(view.input_len, view.cached_tokens(remote)) + fetch
            if remote > local and with_store < dur:
                dur, cached = with_store, view.cached_tokens(remote)
                self.res.store_tokens[i] = cached - view.cached_tokens(local)
        self.res.cached_tokens[i] = cached
        self.res.prefill_busy_s[e] += dur
        eng.busy = True
        self._push(t + dur, _PREFILL_DONE, e, i)

    def _on_prefill_done(self, t: float, e: int, i: int) -> None:
        eng = self.p_eng[e]
        view = self.views[i]
        evicted = eng.insert(view.blocks)
        if self.index is not None:
            self.index.apply_stored(e, view.blocks)
            if evicted:
                self.index.apply_removed(e, evicted)
        if self.store is not None:  # every computed block is written to the store
            dropped = self.store.insert(view.blocks)
            if self.index is not None:
                self.index.store_add(view.blocks)
                self.index.store_remove(dropped)
        self.prefill.on_complete(e, view)
        self.res.ttft_s[i] = t - self.arrival[i]
        eng.busy = False
        if eng.queue:
            self._start_prefill(t, e)
        d = self.decode.select(self._decode_all, view)
        self.res.decode_engine[i] = d
        self._decode_join(t, d, i)

    # -- decode -------------------------------------------------------------------------
    def _decode_join(self, t: float, d: int, i: int) -> None:
        eng = self.d_eng[d]
        eng.advance(t)
        eng.waiting.append(i)
        self._decode_join_t[i] = t
        self._admit(t, d)
        self._reschedule(t, d)

    def _admit(self, t: float, d: int) -> None:
        eng, cfg = self.d_eng[d], self.cfg
        while eng.waiting:
            i = eng.waiting[0]
            ctx = int(self.trace.input_len[i])
            full = eng.batch >= cfg.decode_max_batch or eng.kv() + ctx > cfg.decode_kv_capacity
            if full and eng.batch:
                return
            eng.waiting.popleft()
            self._decode_start[i] = t
            n_tokens = int(self.trace.output_len[i]) - 1
            if n_tokens <= 0:
                self._finish(t, d, i)
                continue
            eng.vjoin[i] = eng.v
            eng.sum_ctx += ctx
            eng.sum_vjoin += eng.v
            heapq.heappush(eng.heap, (eng.v + n_tokens, i))

    def _reschedule(self, t: float, d: int) -> None:
        eng = self.d_eng[d]
        eng.version += 1
        if not eng.batch:
            return
        eng.step = self._step_model.step_time(eng.batch, eng.kv())
        nxt = t + max(eng.heap[0][0] - eng.v, 0.0) * eng.step
        self._push(min(nxt, t + self.cfg.max_step_gap_s), _DECODE_WAKE, d, eng.version)

    def _on_decode_wake(self, t: float, d: int, version: int) -> None:
        eng = self.d_eng[d]
        if version != eng.version:
            return
        eng.advance(t)
        while eng.heap and eng.heap[0][0] <= eng.v + 1e-9:
            _, i = heapq.heappop(eng.heap)
            vj = eng.vjoin.pop(i)
            eng.sum_ctx -= int(self.trace.input_len[i])
            eng.sum_vjoin -= vj
            n_tokens = int(self.trace.output_len[i]) - 1
            self.res.tpot_s[i] = (t - self._decode_start[i]) / n_tokens
            self._finish(t, d, i)
        self._admit(t, d)
        self._reschedule(t, d)

    def _finish(self, t: float, d: int, i: int) -> None:
        self.decode.on_complete(d, self.views[i])
        self.res.makespan_s = max(self.res.makespan_s, t - float(self.arrival[0]))
        self._pending -= 1

    def _on_stats(self, t: float, _a: int, _b: int) -> None:
        loads = []
        for d, eng in enumerate(self.d_eng):
            eng.advance(t)
            # KV held, and owed to the queue: as engines report it (EngineCore's waiting_tokens)
            owed = sum(int(self.trace.input_len[i]) for i in eng.waiting)
            loads.append(EngineLoad(d, running=eng.batch + len(eng.waiting), kv_tokens=int(eng.kv()) + owed))
        self.decode.update_loads(loads)
        if self._pending > 0:
            self._push(t + self.cfg.stats_interval_s, _STATS, 0)

    def _on_sample(self, t: float, _a: int, _b: int) -> None:
        for eng in self.d_eng:
            eng.advance(t)
        self._samples.append((t, [eng.batch for eng in self.d_eng], [eng.kv() for eng in self.d_eng]))
        if self._pending > 0 and self.cfg.sample_interval_s is not None:
            self._push(t + self.cfg.sample_interval_s, _SAMPLE, 0)
