"""`sluice bench swa`'s part 1, on a real engine: per hit length, exact and bounded replay
into a fresh SWA slot timed on one `ModelRunner` (`time_replay`: the hit's prefill into slot 0
`_prefill`, the replays into slot 1 `_time_replays`, their medians `_medians`), and the third
way to rebuild the slot, fetching it from a loopback `SlotServer` (`time_fetch`).
`services.bench.swa`'s module doc says what is timed and how.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench import progress
from services.bench._swa_accounting import bounded_replay, exact_replay

if TYPE_CHECKING:
    from engine.runner import ModelRunner


def time_replay(
    model_dir: Path,
    contexts: Sequence[int],
    repeats: int,
    chunk: int,
    device: str,
    dtype: str,
    seed: int,
    label: str = "",
) -> list[dict[str, Any]]:
    """Per context: prefill it into slot 0, then time exact and bounded replays into slot 1."""
    from engine.config import BLOCK_TOKENS
    from engine.runner import ModelRunner, RunnerConfig

    rows = []
    for hit in contexts:
        blocks = list(range(-(-(hit + 1) // BLOCK_TOKENS)))
        runner = ModelRunner(
            model_dir,
            RunnerConfig(num_blocks=len(blocks), num_slots=2, dtype=dtype, device=device, with_mtp=False),
        )
        cfg = runner.model_cfg
        layers, window = cfg.num_hidden_layers, cfg.sliding_window
        rng = random.Random(seed + hit)
        ids = [rng.randrange(2, cfg.vocab_size) for _ in range(hit + 1)]
        prefill_s = _prefill(runner, ids, hit, blocks, chunk, device, label)
        lengths = {"exact": exact_replay(hit, layers, window), "bounded": bounded_replay(hit, window)}
        times = _time_replays(runner, ids, hit, blocks, lengths, repeats, chunk, device, label)
        row: dict[str, Any] = {"layers": layers, "window": window, "context": hit, "prefill_s": prefill_s}
        row.update(_medians(lengths, times))
        row.update(time_fetch(runner, hit, repeats))
        row["fetch_over_bounded"] = row["fetch_s"] / row["bounded_s"]
        row["bounded_over_exact"] = row["bounded_s"] / row["exact_s"]
        # the fastest repeat of each: the least disturbed by other work on a shared machine
        row["bounded_over_exact_min"] = row["bounded_min_s"] / row["exact_min_s"]
        rows.append(row)
        del runner
    return rows


def _sync(device: str) -> None:
    """Wait for the device's queued work (CUDA only), so that a clock read after it counts it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prefill(
    runner: ModelRunner, ids: list[int], hit: int, blocks: list[int], chunk: int, device: str, label: str
) -> float:
    """The hit's ``hit`` tokens prefilled into slot 0, ``chunk`` at a time: seconds."""
    from engine.forward_batch import ForwardBatch, SequenceInput

    t0 = time.perf_counter()
    for s in range(0, hit, chunk):
        e = min(hit, s + chunk)
        runner.execute(
            ForwardBatch.from_sequences([SequenceInput(ids[s:e], s, 0, blocks, sample=False)], device)
        )
        progress(f"swa {label} ctx {hit}: prefill {e}/{hit} ({time.perf_counter() - t0:.0f} s)")
    _sync(device)
    return time.perf_counter() - t0


def _time_replays(
    runner: ModelRunner,
    ids: list[int],
    hit: int,
    blocks: list[int],
    lengths: dict[str, int],
    repeats: int,
    chunk: int,
    device: str,
    label: str,
) -> dict[str, list[tuple[float, float]]]:
    """Per policy, ``repeats`` times (exact and bounded alternating which goes first): slot 1
    zeroed, the policy's replay of the hit's last ``lengths[policy]`` tokens into it (chunked,
    ``rows_cached_until = hit``), then one decoded token: (replay s, decode s) per repeat."""
    from engine.forward_batch import ForwardBatch, SequenceInput

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in lengths}
    for rep in range(repeats):
        for policy in ("exact", "bounded") if rep % 2 == 0 else ("bounded", "exact"):
            r = lengths[policy]
            for t in runner.swa.slot_tensors(1):
                t.zero_()
            _sync(device)
            t1 = time.perf_counter()
            for s in range(hit - r, hit, chunk):
                e = min(hit, s + chunk)
                seq = SequenceInput(
                    ids[s:e], s, 1, blocks, sample=False, rows_cached_until=hit, window_from=hit - r
                )
                runner.execute(ForwardBatch.from_sequences([seq], device))
            _sync(device)
            t2 = time.perf_counter()
            runner.execute(ForwardBatch.from_sequences([SequenceInput([ids[hit]], hit, 1, blocks)], device))
            _sync(device)
            t3 = time.perf_counter()
            times[policy].append((t2 - t1, t3 - t2))
            progress(
                f"swa {label} ctx {hit}: {policy} replay {r} tokens {t2 - t1:.2f} s + decode {t3 - t2:.3f} s"
            )
    return times


def _medians(lengths: dict[str, int], times: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per policy: its replay length, the median replay, decode and total seconds, the fastest
    total and every total."""
    out: dict[str, Any] = {}
    for policy, ts in times.items():
        out[f"{policy}_tokens"] = lengths[policy]
        out[f"{policy}_replay_s"] = statistics.median(a for a, _ in ts)
        out[f"{policy}_decode_s"] = statistics.median(b for _, b in ts)
        out[f"{policy}_s"] = statistics.median(a + b for a, b in ts)
        out[f"{policy}_min_s"] = min(a + b for a, b in ts)
        out[f"{policy}_all_s"] = [a + b for a, b in ts]
    return out


def time_fetch(runner: Any, hit: int, repeats: int) -> dict[str, Any]:
    """The other way to rebuild the slot: fetch it from the engine that holds it. Slot 0's
    state (exact at ``hit``) and its partial block go into a host slot pool served by a
    ``SlotServer`` on loopback; each repeat fetches them over gRPC, verifies them and writes
    the slot into slot 1: the whole remote path, seconds (median)."""
    import hashlib

    from engine.config import BLOCK_TOKENS
    from engine.kvconnector import caches
    from engine.kvconnector import payload as fmt
    from engine.kvconnector.slot_server import SlotServer, fetch_slot
    from engine.scheduler.host_slots import HostSlot, HostSlotPool

    fp = hashlib.sha256(b"sluice bench swa").digest()[:16]
    dtype = runner.cfg.torch_dtype
    digest = fmt.layout_digest(runner.spec, dtype)
    slot = caches.pack_slot(runner.swa, 0, fp, digest)
    tail_tokens = hit % BLOCK_TOKENS
    tail = caches.pack_block(runner.pool, hit // BLOCK_TOKENS, fp, digest) if tail_tokens else None
    anchor = hashlib.sha256(b"anchor").digest()
    key = tuple(range(tail_tokens))
    pool = HostSlotPool(4 * (len(slot) + len(tail or b"")))
    pool.put(HostSlot(anchor, hit, key, slot, tail))

    def verify(entry: HostSlot) -> None:
        fmt.decode(entry.slot_payload, kind=fmt.KIND_SLOT, fingerprint=fp, digest=digest, dtype=dtype)

    server = SlotServer(pool)
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = fetch_slot(server.address, anchor, key, hit, verify, timeout_s=60)
            assert got is not None, "the loopback slot server did not answer"
            caches.unpack_slot_into(got.slot_payload, runner.swa, 1, fp, digest)
            times.append(time.perf_counter() - t0)
    finally:
        server.stop()
    return {"fetch_s": statistics.median(times), "fetch_bytes": len(slot) + len(tail or b"")}
