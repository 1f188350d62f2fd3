"""Async adapter around the pure router policies, for the live disaggregated stack.

The API server awaits ``route_prefill`` / ``route_decode`` per request; engine actors push
``on_engine_stats`` (their periodic load report) and ``on_cache_event`` (blocks stored /
evicted, as chained SHA-256 block hashes in bytes or hex); what the engines saw in the KV
store arrives as ``on_store_directory`` and its measured fetch cost as
``set_store_fetch_cost``. Policies are synchronous and take microseconds, so one
``asyncio.Lock`` serialises them on the event loop; nothing here blocks or does I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from costmodel import CostModel, DecodeCostModel
from router import cache_aware, sluice  # noqa: F401  (registers policies)
from router.policy import DECODE_POLICIES, PREFILL_POLICIES, EngineLoad, Policy, PolicyContext, RequestView
from router.prefix_index import PrefixIndex, PrefixIndexConfig

_STAT_FIELDS = {"running": int, "kv_tokens": int, "queued_work_s": float, "kv_capacity": int}


@dataclass(frozen=True)
class RouterAdapterConfig:
    policy: str = "sluice"
    num_prefill: int = 1
    num_decode: int = 1
    cost: CostModel = CostModel()
    decode_cost: DecodeCostModel = DecodeCostModel()
    # seconds to fetch one block from the KV store; None: the sluice policy ignores the store
    # (live serving sets it from the engines' measurement: ``set_store_fetch_cost``)
    store_fetch_s_per_block: float | None = None
    # blocks the index's store view keeps, least recently added dropped first; None: no
    # bound (only for a directory that publishes every drop, see PrefixIndexConfig)
    store_capacity_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"router needs >= 1 prefill and decode engine, got {self.num_prefill}/{self.num_decode}"
            )
        known = sorted(set(PREFILL_POLICIES.names()) & set(DECODE_POLICIES.names()))
        if self.policy not in known:
            raise ValueError(f"unknown router policy {self.policy!r}; known: {', '.join(known)}")
        _check_fetch_cost(self.store_fetch_s_per_block)


def _block_id(b: bytes | str | int) -> Hashable:
    """Normalise a block hash: hex strings and bytes name the same block."""
    if isinstance(b, str):
        try:
            return bytes.fromhex(b)
        except ValueError as exc:
            raise ValueError(f"block hash {b[:16]!r}... is not hex") from exc
    return b


def _check_fetch_cost(seconds_per_block: float | None) -> None:
    if seconds_per_block is not None and not seconds_per_block >= 0:  # NaN too
        raise ValueError(f"store fetch cost must be >= 0 s per block or None, got {seconds_per_block!r}")


class RouterAdapter:
    def __init__(self, config: RouterAdapterConfig) -> None:
        self.config = config
        self.index = PrefixIndex(
            PrefixIndexConfig(config.num_prefill, store_capacity_blocks=config.store_capacity_blocks)
        )
        pctx = PolicyContext(config.num_prefill, self.index, config.cost, config.decode_cost)
        dctx = PolicyContext(config.num_decode, cost=config.cost, decode_cost=config.decode_cost)
        if config.policy == "sluice":
            sconf = sluice.SluicePrefillConfig(store_fetch_s_per_block=config.store_fetch_s_per_block)
            self.prefill: Policy = sluice.SluicePrefill(pctx, sconf)
        else:
            self.prefill = PREFILL_POLICIES.create(config.policy, pctx)
        self.decode: Policy = DECODE_POLICIES.create(config.policy, dctx)
        self._lock = asyncio.Lock()

    @staticmethod
    def request(
        request_id: str,
        input_len: int,
        blocks: Sequence[bytes | str],
        arrival_s: float,
        block_size: int = 256,
    ) -> RequestView:
        return RequestView(request_id, input_len, [_block_id(b) for b in blocks], arrival_s, 0, block_size)

    async def route_prefill(self, request: RequestView, candidates: Sequence[int]) -> int:
        async with self._lock:
            return self.prefill.select(candidates, request)

    async def route_decode(self, request: RequestView, candidates: Sequence[int]) -> int:
        async with self._lock:
            return self.decode.select(candidates, request)

    async def prefill_done(self, engine: int, request: RequestView) -> None:
        async with self._lock:
            self.prefill.on_complete(engine, request)

    async def decode_done(self, engine: int, request: RequestView) -> None:
        async with self._lock:
            self.decode.on_complete(engine, request)

    async def on_engine_stats(self, stage: str, stats: Sequence[Mapping[str, object]]) -> None:
        """Engine load reports: ``{"engine": i, "running": n, "kv_tokens": k, ...}``.

        Raises ValueError for an unknown stage, a missing engine index or a bad field.
        """
        policy = {"prefill": self.prefill, "decode": self.decode}.get(stage)
        if policy is None:
            raise ValueError(f"unknown stage {stage!r}; expected 'prefill' or 'decode'")
        loads = [self._load(s, policy.ctx.num_engines) for s in stats]
        async with self._lock:
            policy.update_loads(loads)

    async def on_cache_event(
        self, engine: int, stored: Sequence[bytes | str] = (), removed: Sequence[bytes | str] = ()
    ) -> None:
        async with self._lock:
            if stored:
                self.index.apply_stored(engine, [_block_id(b) for b in stored])
            if removed:
                self.index.apply_removed(engine, [_block_id(b) for b in removed])

    async def on_cache_snapshot(self, engine: int, blocks: Sequence[bytes | str]) -> None:
        """Replace everything known about ``engine``'s cache with ``blocks`` (it lost events)."""
        async with self._lock:
            self.index.clear_engine(engine)
            self.index.apply_stored(engine, [_block_id(b) for b in blocks])

    async def on_engine_down(self, engine: int) -> None:
        """``engine`` left the pool or restarted: it holds nothing the router can count on."""
        async with self._lock:
            self.index.clear_engine(engine)

    async def on_store_directory(
        self, added: Sequence[bytes | str] = (), removed: Sequence[bytes | str] = ()
    ) -> None:
        async with self._lock:
            self.index.store_add(_block_id(b) for b in added)
            self.index.store_remove(_block_id(b) for b in removed)

    async def set_store_fetch_cost(self, seconds_per_block: float | None) -> None:
        """Seconds to fetch one block from the KV store, as measured by the engines; None:
        ignore the store (nothing measured yet). Only ``sluice`` prices store hits; the other
        policies ignore it. Raises ValueError for a negative or NaN cost."""
        _check_fetch_cost(seconds_per_block)
        async with self._lock:
            self.config = replace(self.config, store_fetch_s_per_block=seconds_per_block)
            if isinstance(self.prefill, sluice.SluicePrefill):
                self.prefill.config = replace(self.prefill.config, store_fetch_s_per_block=seconds_per_block)

    @staticmethod
    def _load(raw: Mapping[str, object], num_engines: int) -> EngineLoad:
        engine = raw.get("engine")
        if not isinstance(engine, int) or not 0 <= engine < num_engines:
            raise ValueError(f"engine stats need 'engine' in 0..{num_engines - 1}, got {engine!r}")
        unknown = set(raw) - set(_STAT_FIELDS) - {"engine"}
        if unknown:
            raise ValueError(f"unknown engine stat fields {sorted(unknown)}; known: {sorted(_STAT_FIELDS)}")
        fields: dict[str, int | float] = {}
        for name, kind in _STAT_FIELDS.items():
            if raw.get(name) is not None:
                value = raw[name]
                if not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"engine stat {name!r} must be a number >= 0, got {value!r}")
                fields[name] = kind(value)
        return EngineLoad(engine, **fields)  # type: ignore[arg-type]
