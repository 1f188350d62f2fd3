"""``sluice bench prefix``: instrumentation of the engines under test (timers around the
connector, a record of what it wrote) and one request served start to finish, with the
helpers that reset an engine's local cache and read the store's own counters."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Served:
    """One request from ``add`` to its first (only) token, and until the engine is idle."""

    ttft_s: float
    idle_s: float  # first token plus the write-through snapshot of its blocks
    token: int
    cached_tokens: int
    step_s: float  # executed steps (executor thread): block loads and the forward
    steps: int
    fetch_s: float | None = None  # add -> the store's answer (hit arm)
    verify_s: float = 0.0
    load_s: float = 0.0
    snapshot_s: float = 0.0  # packing the new blocks' payloads (write arm; on the step path)


@dataclass
class Probe:
    """Timers around the connector of one engine (store reads, verification, block loads)
    and a record of what it wrote; bench instrumentation, the engine is unchanged."""

    fetch_done: list[float] = field(default_factory=list)
    verify_s: float = 0.0
    load_s: float = 0.0
    snapshot_s: float = 0.0
    put_s: float = 0.0  # wall time of put_blocks calls (the connector's writer thread)
    payload_sizes: list[int] = field(default_factory=list)
    stored_spans: list[int] = field(default_factory=list)  # bytes of each block the store reports stored
    objects: dict[bytes, int] = field(default_factory=dict)  # object id -> object bytes
    lock: threading.Lock = field(default_factory=threading.Lock)


def instrument(core: Any) -> Probe:
    probe = Probe()
    conn, kv = core.store, core.kv

    fetch = conn.fetch

    def timed_fetch(hashes: Sequence[bytes]) -> Any:
        pending = fetch(hashes)
        pending.future.add_done_callback(lambda _f: probe.fetch_done.append(time.perf_counter()))
        return pending

    verify = conn.verify

    def timed_verify(payload: bytes) -> None:
        t0 = time.perf_counter()
        try:
            verify(payload)
        finally:
            probe.verify_s += time.perf_counter() - t0

    load = kv.load_block

    def timed_load(pool: Any, block: int, payload: bytes) -> None:
        t0 = time.perf_counter()
        load(pool, block, payload)
        probe.load_s += time.perf_counter() - t0

    save = kv.save

    def timed_save(pool: Any, saves: Any) -> None:
        t0 = time.perf_counter()
        save(pool, saves)
        probe.snapshot_s += time.perf_counter() - t0

    put = conn.client.put_blocks

    def recorded_put(hashes: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = "chat") -> Any:
        t0 = time.perf_counter()
        metas = put(hashes, payloads, traffic_class)
        with probe.lock:
            probe.put_s += time.perf_counter() - t0
            probe.payload_sizes += [len(p) for p in payloads]
            for meta in metas:
                start, end = meta.span()
                probe.stored_spans.append(end - start)
                probe.objects[meta.object_id] = meta.size
        return metas

    conn.fetch, conn.verify, kv.load_block, kv.save, conn.client.put_blocks = (
        timed_fetch, timed_verify, timed_load, timed_save, recorded_put,
    )  # fmt: skip
    return probe


def serve(core: Any, rid: str, prompt: Sequence[int], probe: Probe | None = None) -> Served:
    from engine.core import CoreRequest
    from engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if probe is not None:
        probe.fetch_done.clear()
        probe.verify_s = probe.load_s = probe.snapshot_s = 0.0
    steps0 = core.loop.steps
    t0 = time.perf_counter()
    core.add(CoreRequest(rid, tuple(prompt), params))
    first = None
    while first is None:
        for out in core.step():
            if out.request_id == rid and out.finish_reason is not None:
                if out.finish_reason != "length" or len(out.new_token_ids) != 1:
                    raise RuntimeError(f"{rid}: finished {out.finish_reason!r} ({out.error})")
                first = out
    ttft = time.perf_counter() - t0
    # The blocks published by the last step are snapshotted when the engine goes idle (on
    # the step path, not the store's): that is part of the write-through cost, so it is in.
    while core.has_work() or core.scheduler.cache.pending_saves:
        core.step()
    idle = time.perf_counter() - t0
    n = core.loop.steps - steps0
    stats = list(core.loop.stats)[-n:] if n else []
    served = Served(
        ttft, idle, first.new_token_ids[0], first.cached_tokens, sum(s.seconds for s in stats), n
    )  # fmt: skip
    if probe is not None:
        served.fetch_s = probe.fetch_done[0] - t0 if probe.fetch_done else None
        served.verify_s, served.load_s, served.snapshot_s = probe.verify_s, probe.load_s, probe.snapshot_s
    return served


def reset_local(core: Any) -> None:
    """Forget the engine's local prefix cache: retained SWA slots (and their partial blocks),
    then every idle cached block. Nothing runs, so nothing is referenced."""
    cache = core.scheduler.cache
    while (entry := cache.slots.evict_oldest()) is not None:
        if entry.partial_block is not None:
            cache.blocks.release([entry.partial_block])
        cache.slots.free(entry.slot)
    cache.blocks.reset_prefix_cache()
    if cache.blocks.num_available != cache.blocks.num_blocks:
        raise RuntimeError("local cache reset left blocks referenced")


def node_usage(core: Any) -> tuple[int, int]:
    """(used bytes, shards) summed over the store's nodes (their NodeStats RPC)."""
    used = shards = 0
    for transport in core.store.client.transports.values():
        st = transport.stats(5.0)
        used, shards = used + st.used_bytes, shards + st.shard_count
    return used, shards


def cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick
