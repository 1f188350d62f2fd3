"""Decision-latency micro benchmark: policy ``select`` with a large prefix index, in-process."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from router import gctune
from router.evaluate import build
from router.policy import Policy, RequestView
from router.prefix_index import PrefixIndex
from router.sim import SimConfig


@dataclass(frozen=True)
class MicroResult:
    policy: str
    indexed_blocks: int
    decisions: int
    p50_us: float
    p99_us: float
    max_us: float
    cpu_p99_us: float  # thread CPU time: excludes waits for the core on a shared machine
    tuned_gc: bool


def micro(
    policy: str = "sluice",
    num_engines: int = 8,
    indexed_blocks: int = 100_000,
    blocks_per_request: int = 64,
    decisions: int = 20_000,
    seed: int = 0,
    tuned_gc: bool = True,
) -> MicroResult:
    """Time ``select`` + ``on_complete`` with ``indexed_blocks`` blocks spread over the engines.

    The index holds prefixes of ``blocks_per_request`` blocks, each on one or two engines.
    Requests reuse a random indexed prefix up to a random depth, then add fresh blocks, so
    lookups walk long matches and diverge, as in chat traffic. Block ids are 32-byte
    digests (the live engine's SHA-256 block hashes), not small ints. ``tuned_gc``: time
    the decisions with ``router.gctune.tune_for_latency`` applied once the index is built,
    as the live router runs; False keeps CPython's default collector settings.
    """
    rng = np.random.default_rng(seed)
    cfg = SimConfig(num_prefill=num_engines, num_decode=num_engines)
    pre, _, index = build(policy, cfg)
    n_prefixes = max(indexed_blocks // blocks_per_request, 1)
    ids = rng.bytes(32 * (n_prefixes * blocks_per_request))
    prefixes = [
        [
            ids[(p * blocks_per_request + j) * 32 : (p * blocks_per_request + j + 1) * 32]
            for j in range(blocks_per_request)
        ]
        for p in range(n_prefixes)
    ]
    for p, blocks in enumerate(prefixes):
        index.apply_stored(p % num_engines, blocks)
        if p % 3 == 0:
            index.apply_stored((p + 1) % num_engines, blocks[: blocks_per_request // 2])
    engines = list(range(num_engines))
    previous_gc = gctune.tune_for_latency() if tuned_gc else None
    try:
        lat, cpu = _time_decisions(pre, index, prefixes, engines, decisions, rng)
    finally:
        if previous_gc is not None:
            gctune.restore(previous_gc)
    return MicroResult(
        policy,
        len(index),
        decisions,
        float(np.percentile(lat, 50)),
        float(np.percentile(lat, 99)),
        float(lat.max()),
        float(np.percentile(cpu, 99)),
        tuned_gc,
    )


def _time_decisions(
    pre: Policy,
    index: PrefixIndex,
    prefixes: list[list[bytes]],
    engines: list[int],
    decisions: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    n_prefixes, blocks_per_request = len(prefixes), len(prefixes[0])
    lat = np.empty(decisions, dtype=np.float64)
    cpu = np.empty(decisions, dtype=np.float64)
    for k in range(decisions):
        prefix = prefixes[int(rng.integers(n_prefixes))]
        depth = int(rng.integers(0, blocks_per_request + 1))
        blocks = prefix[:depth] + [rng.bytes(32) for _ in range(blocks_per_request - depth)]
        view = RequestView(k, blocks_per_request * 512, blocks, arrival_s=k * 0.01)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        e = pre.select(engines, view)
        lat[k] = (time.perf_counter_ns() - t0) / 1e3
        cpu[k] = (time.thread_time_ns() - c0) / 1e3
        pre.on_complete(e, view)
        if depth < blocks_per_request:  # keep the index near its size: fresh blocks were inserted
            index.apply_removed(e, blocks[depth:])
    return lat, cpu
