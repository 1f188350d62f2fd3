"""Router policy contract, typed registries and shared request/load types.

A policy is a pure object driven with plain data (no sockets, no clocks of its own):

* ``select(candidates, request) -> engine`` picks one of ``candidates`` (engine indices
  into the pool) for ``request``. It may update the policy's own bookkeeping (outstanding
  work, an approximate prefix tree) as if the request had been sent. It raises
  ``NoCandidates`` when ``candidates`` is empty. It never blocks.
* ``on_complete(engine, request)`` says the engine finished the stage for ``request``;
  the policy releases what ``select`` charged. Unknown requests are ignored (idempotent).
* ``update_loads(loads)`` replaces the policy's view of engine load with what engines
  reported (``EngineLoad``); fields an engine does not report are left as the policy had
  them.

Prefill and decode have one registry each; the four names (``round_robin``,
``least_load``, ``cache_aware``, ``sluice``) exist in both, so a router is named once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from costmodel import CostModel, DecodeCostModel
from router.prefix_index import PrefixIndex, PrefixIndexConfig

T = TypeVar("T")
DEFAULT_BLOCK_SIZE = 512  # tokens per block in the Mooncake traces


class NoCandidates(ValueError):
    """``select`` was called with no candidate engine (the pool is empty or all excluded)."""


@dataclass(frozen=True)
class RequestView:
    """What the router knows about a request when it routes it."""

    request_id: Hashable
    input_len: int
    blocks: Sequence[Hashable] = ()  # chained prefix block ids, first block first
    arrival_s: float = 0.0
    output_len_hint: int = 0  # expected output tokens; 0 when unknown
    block_size: int = DEFAULT_BLOCK_SIZE
    image_tokens: int = 0
    # A hit found without its sliding-window state recomputes this many of its last tokens
    # to rebuild it (exact replay: layers x (window - 1); bounded: window - 1); 0: free hits.
    swa_replay_tokens: int = 0
    # A sliding-window slot of the SWA directory that this prompt extends (0 tokens: none
    # known): its position, the blocks up to and including its anchor (0: the root), the
    # engines that hold it, and what fetching it costs any other engine, in prefill tokens
    # (``slot_fetch_tokens``). Only ``cached_tokens(m, engine)`` reads them.
    swa_slot_tokens: int = 0
    swa_slot_blocks: int = 0
    swa_slot_holders: frozenset[int] = frozenset()
    swa_fetch_tokens: int = 0
    swa_slot_replay: int = 0  # tokens a hit on the slot still replays (layers it does not keep)

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"RequestView.input_len must be >= 1, got {self.input_len} (empty prompt)")
        if self.block_size < 1:
            raise ValueError(f"RequestView.block_size must be >= 1, got {self.block_size}")
        if self.swa_replay_tokens < 0:
            raise ValueError(f"RequestView.swa_replay_tokens must be >= 0, got {self.swa_replay_tokens}")
        if self.swa_slot_tokens:
            start = self.swa_slot_blocks * self.block_size
            if not start <= self.swa_slot_tokens < min(start + self.block_size, self.input_len):
                raise ValueError(
                    f"RequestView: a slot at {self.swa_slot_tokens} tokens must lie in the block after its "
                    f"anchor ({self.swa_slot_blocks} blocks of {self.block_size}) and before the prompt's "
                    f"last token ({self.input_len})"
                )
        if min(self.swa_slot_tokens, self.swa_slot_blocks, self.swa_fetch_tokens, self.swa_slot_replay) < 0:
            raise ValueError(
                "RequestView: swa_slot_tokens, swa_slot_blocks, swa_fetch_tokens and swa_slot_replay must be >= 0"
            )

    def cached_tokens(self, matched_blocks: int, engine: int | None = None) -> int:
        """Prompt tokens a hit of ``matched_blocks`` saves: the hit less its window replay
        (the engine recomputes the whole prompt when the replay would cover the hit).

        With ``engine`` and a directory slot (``swa_slot_tokens``) whose anchor block is among
        the engine's ``matched_blocks``, the engine rebuilds the window from the slot instead
        when that saves more: its holders save the slot's position, with no replay; any other
        engine fetches it first, which costs ``swa_fetch_tokens``; a slot that keeps only some
        layers still replays ``swa_slot_replay`` tokens. Never more than the hit
        plus the slot's tail."""
        hit = min(int(matched_blocks) * self.block_size, self.input_len)
        saved = hit - min(self.swa_replay_tokens, hit)
        if engine is None or not self.swa_slot_tokens or matched_blocks < self.swa_slot_blocks:
            return saved
        slot = self.swa_slot_tokens - min(self.swa_slot_replay, self.swa_slot_tokens)
        if engine not in self.swa_slot_holders:
            slot -= self.swa_fetch_tokens
        # the anchor is within the hit and the tail within one block (__post_init__), so the
        # slot never saves more than the hit plus its tail
        return max(saved, slot)


def slot_fetch_tokens(
    cost: CostModel, position: int, slot_bytes: float, bytes_per_s: float, round_trip_s: float
) -> int:
    """What fetching a ``slot_bytes`` sliding-window slot at ``position`` from its holder costs
    another engine, in prefill token-equivalents (docs/router.md, "SWA slots"): the transfer
    (bytes over the link's bandwidth) plus one round trip, divided by the prefill cost
    model's marginal time of one token computed after ``position`` cached ones
    (``a * position + b + d``). At most ``position``: a fetch never saves less than nothing."""
    if slot_bytes < 0 or bytes_per_s <= 0 or round_trip_s < 0:
        raise ValueError(
            f"slot_fetch_tokens: need slot_bytes >= 0, bytes_per_s > 0 and round_trip_s >= 0, "
            f"got {slot_bytes}, {bytes_per_s}, {round_trip_s}"
        )
    seconds = slot_bytes / bytes_per_s + round_trip_s
    per_token = cost.a * position + cost.b + cost.d
    if per_token <= 0:
        return position
    return min(position, math.ceil(seconds / per_token))


@dataclass(frozen=True)
class EngineLoad:
    """Load an engine reports. ``None`` fields are not reported by this engine."""

    engine: int
    running: int | None = None  # requests in the engine (queued + running)
    kv_tokens: int | None = None  # KV tokens held by running requests and owed to queued ones
    queued_work_s: float | None = None  # predicted seconds of prefill work not yet done
    kv_capacity: int | None = None


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is built with: pool size, shared index and cost models."""

    num_engines: int
    index: PrefixIndex | None = None
    cost: CostModel = field(default_factory=CostModel)
    decode_cost: DecodeCostModel = field(default_factory=DecodeCostModel)

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"PolicyContext.num_engines must be >= 1, got {self.num_engines}")
        if self.index is not None and self.index.config.num_engines != self.num_engines:
            raise ValueError(
                f"PolicyContext: index covers {self.index.config.num_engines} engines, pool has {self.num_engines}"
            )

    def shared_index(self) -> PrefixIndex:
        return self.index if self.index is not None else PrefixIndex(PrefixIndexConfig(self.num_engines))


class Policy(ABC):
    """Base of every policy: outstanding-work bookkeeping charged by select, released on complete."""

    name: str = "?"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        n = ctx.num_engines
        self.outstanding = np.zeros(n, dtype=np.int64)  # requests sent and not completed
        self.outstanding_tokens = np.zeros(n, dtype=np.float64)  # tokens charged (policy-defined)
        self.outstanding_work = np.zeros(n, dtype=np.float64)  # predicted seconds charged
        self._charged: dict[Hashable, tuple[int, float, float]] = {}

    @abstractmethod
    def select(self, candidates: Sequence[int], request: RequestView) -> int: ...

    def on_complete(self, engine: int, request: RequestView) -> None:
        charged = self._charged.pop(request.request_id, None)
        if charged is None:
            return
        e, tokens, work = charged
        self.outstanding[e] = max(self.outstanding[e] - 1, 0)
        self.outstanding_tokens[e] = max(self.outstanding_tokens[e] - tokens, 0.0)
        self.outstanding_work[e] = max(self.outstanding_work[e] - work, 0.0)

    def update_loads(self, loads: Sequence[EngineLoad]) -> None:
        for load in loads:
            if load.running is not None:
                self.outstanding[load.engine] = load.running
            if load.queued_work_s is not None:
                self.outstanding_work[load.engine] = load.queued_work_s

    def _charge(self, engine: int, request: RequestView, tokens: float, work: float = 0.0) -> int:
        self._charged[request.request_id] = (engine, tokens, work)
        self.outstanding[engine] += 1
        self.outstanding_tokens[engine] += tokens
        self.outstanding_work[engine] += work
        return engine


def candidates_array(candidates: Sequence[int]) -> np.ndarray:
    if len(candidates) == 0:
        raise NoCandidates("no candidate engine to route to (empty pool or all engines excluded)")
    return np.asarray(candidates, dtype=np.int64)


class Registry(Generic[T]):
    """Name -> factory, filled by decorator; an unknown name lists the known ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._items:
                raise ValueError(f"{self.kind} policy {name!r} registered twice")
            self._items[name] = factory
            return factory

        return deco

    def create(self, name: str, *args: object, **kwargs: object) -> T:
        if name not in self._items:
            raise ValueError(f"unknown {self.kind} policy {name!r}; known: {', '.join(self.names())}")
        return self._items[name](*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._items)


PREFILL_POLICIES: Registry[Policy] = Registry("prefill")
DECODE_POLICIES: Registry[Policy] = Registry("decode")


def argmin_tiebreak(scores: np.ndarray, cands: np.ndarray) -> int:
    """The candidate with the lowest score; ties go to the lowest engine index."""
    return int(min(zip(scores.tolist(), cands.tolist()))[1])


@PREFILL_POLICIES.register("round_robin")
@DECODE_POLICIES.register("round_robin")
class RoundRobin(Policy):
    """Cycles through the candidates in engine order, ignoring load and cache."""

    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = np.sort(candidates_array(candidates))
        later = cands[cands >= self._next]
        e = int(later[0]) if len(later) else int(cands[0])
        self._next = e + 1
        return self._charge(e, request, request.input_len)


@PREFILL_POLICIES.register("least_load")
@DECODE_POLICIES.register("least_load")
class LeastLoad(Policy):
    """Fewest outstanding tokens (prefill: input tokens queued; decode: KV tokens held).

    Ties break on fewer outstanding requests, then on the lowest engine index.
    """

    name = "least_load"

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = candidates_array(candidates)
        scores = self.outstanding_tokens[cands] * 1e6 + self.outstanding[cands]
        return self._charge(argmin_tiebreak(scores, cands), request, request.input_len)

    def update_loads(self, loads: Sequence[EngineLoad]) -> None:
        super().update_loads(loads)
        for load in loads:
            if load.kv_tokens is not None:
                self.outstanding_tokens[load.engine] = load.kv_tokens
