"""``cache_aware``: the SGLang model gateway's cache-aware policy, re-expressed over blocks.

SGLang keeps an approximate radix tree per worker, filled at routing time (the router
assumes the worker will cache what it was sent) and trimmed by LRU. Because our block ids
are chained hashes, a per-worker LRU set of blocks is exactly that tree. The rule
(SGLang docs, ``sgl_model_gateway.md``; thresholds are its defaults):

1. Imbalanced when ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold * min_load`` (load = requests in flight): send to
   the least loaded worker.
2. Otherwise, ``match_rate = matched tokens / input tokens`` of the best-matching worker;
   if ``match_rate > cache_threshold`` send there, else to the worker with the smallest tree.
3. Insert the request's blocks into the chosen worker's tree.

Decode has no prefix reuse; SGLang's PD mode balances decode separately, which we model as
fewest requests in flight (``cache_aware`` in the decode registry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.policy import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    Policy,
    PolicyContext,
    RequestView,
    argmin_tiebreak,
    candidates_array,
)
from router.prefix_index import PrefixIndex, PrefixIndexConfig


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_blocks: int = 32_768  # per worker; matches the simulated engine cache by default

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1.0")
        if self.max_tree_blocks < 1:
            raise ValueError(f"max_tree_blocks must be >= 1, got {self.max_tree_blocks}")


@PREFILL_POLICIES.register("cache_aware")
class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, ctx: PolicyContext, config: CacheAwareConfig | None = None) -> None:
        super().__init__(ctx)
        self.config = config or CacheAwareConfig()
        self.tree = PrefixIndex(
            PrefixIndexConfig(ctx.num_engines, capacity_blocks=self.config.max_tree_blocks)
        )

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = candidates_array(candidates)
        cfg = self.config
        loads = self.outstanding[cands]
        max_load, min_load = int(loads.max()), int(loads.min())
        if (
            max_load - min_load > cfg.balance_abs_threshold
            and max_load > cfg.balance_rel_threshold * min_load
        ):
            e = argmin_tiebreak(loads.astype(np.float64), cands)
        else:
            matched = self.tree.match(request.blocks)[cands].tolist()
            # the best-matching worker: most tokens saved (a holder of the request's directory
            # slot saves its window replay: RequestView.cached_tokens), then longest match
            saved = [request.cached_tokens(m, int(c)) for m, c in zip(matched, cands.tolist())]
            pos = min(range(len(matched)), key=lambda i: (-saved[i], -matched[i], int(cands[i])))
            rate = saved[pos] / request.input_len
            if matched[pos] > 0 and rate > cfg.cache_threshold:
                e = int(cands[pos])
            else:
                sizes = np.array([self.tree.engine_blocks(int(c)) for c in cands], dtype=np.float64)
                e = argmin_tiebreak(sizes, cands)
        self.tree.apply_stored(e, request.blocks)
        return self._charge(e, request, request.input_len)


@DECODE_POLICIES.register("cache_aware")
class FewestRequests(Policy):
    """Decode side of ``cache_aware``: fewest requests in flight, lowest index on ties."""

    name = "cache_aware"

    def select(self, candidates: Sequence[int], request: RequestView) -> int:
        cands = candidates_array(candidates)
        e = argmin_tiebreak(self.outstanding[cands].astype(np.float64), cands)
        return self._charge(e, request, request.input_len)
