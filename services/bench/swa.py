"""SWA slot rebuild: exact vs bounded replay time, prefill tokens on a trace, slot bytes.

A prefix hit whose sliding-window (SWA) slot is gone rebuilds the slot by replaying the last
r tokens of the hit into a fresh slot (``engine/cache/swa.py``): exactly with
r = min(hit, L * (W - 1)), or approximately ("bounded replay") with r = min(hit, W - 1).
Three figures:

1. ``timing``: random checkpoints of the ``small`` preset's widths resized to each of
   ``--layers`` (extra layers alternate CSA/HCA, ``preset_config``). For each hit length in
   ``--contexts`` the hit is prefilled once into slot 0 (chunked, untimed); then, ``--repeats``
   times into a zeroed slot 1, the replay forward (chunked like the prefill) with
   ``rows_cached_until = hit`` and ``window_from = hit - r``, and one decoded token after it,
   are timed, exact and bounded alternating. Medians are reported. Beside them, the third
   way to rebuild the slot: fetching it from the engine that holds it (a ``SlotServer`` on
   loopback, gRPC, verified, written into slot 1), timed the same way (:func:`time_fetch`).
2. ``trace``: prefill tokens on the Mooncake conversation trace at the V4-Flash shape
   (43 layers, W = 128) under an unbounded prefix cache, for exact replay, bounded replay and
   an LRU pool of host-memory slots (bounded replay when the pool misses). See
   :func:`trace_accounting` for the hit and keying rules.
3. ``slot_bytes``: bytes of one sequence's SWA slot in our layout (``engine/cache/spec.py``)
   at the V4-Flash widths, in bf16 and MXFP8, beside DeepSeek's 1,415,040 bytes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "data/traces/conversation_trace.jsonl"
DEFAULT_LAYERS = "6,12,24,43"
DEFAULT_CONTEXTS = "4096,16384,65536"
TARGET_LAYERS, TARGET_CONTEXT, TARGET_RATIO = 43, 16384, 0.1
FETCH_TARGET_RATIO = 0.2  # a remote slot fetch against a bounded replay, same cell

# V4-Flash shape for the trace accounting and the slot bytes.
FLASH_LAYERS, FLASH_WINDOW = 43, 128
KEPT_LAYERS = 20  # V4.1-Flash layers whose SWA state DeepSeek keeps in host memory
DEEPSEEK_TOKENS_PER_LAYER = 134
DEEPSEEK_SLOT_BYTES = 1_415_040  # 20 layers x 134 tokens x 528 bytes
MX_BLOCK = 32  # MXFP8: one power-of-two scale byte per 32 e4m3 values
GIB = 1024**3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--layers", default=DEFAULT_LAYERS, help=f"decoder layers, comma-separated (default {DEFAULT_LAYERS})"
    )
    p.add_argument(
        "--contexts", default=DEFAULT_CONTEXTS,
        help=f"hit lengths in tokens, comma-separated (default {DEFAULT_CONTEXTS}; on this 2-core CPU "
        "only a subset fits ~10 minutes, see docs/benchmarks.md)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timed replays per policy (median; default 3)")
    p.add_argument(
        "--chunk", type=int, default=2048, help="tokens per forward step of prefill and replay (default 2048)"
    )
    p.add_argument("--device", default="cpu", help="torch device of the runner (cpu, cuda; default cpu)")
    p.add_argument("--dtype", default="float32", help="runner dtype (float32, bfloat16; default float32)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default 0: torch's choice)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoints and the prompts")
    p.add_argument("--no-timing", action="store_true", help="skip part 1 (the model runs)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace for part 2")
    p.add_argument(
        "--host-gib", default="64,512",
        help="host memory per node for SWA slots, GiB, comma-separated (default 64,512)",
    )  # fmt: skip


def parse_ints(text: str, name: str, minimum: int = 1) -> list[int]:
    values = [int(s) for s in text.split(",") if s.strip()]
    if not values or min(values) < minimum:
        raise ValueError(f"{name} needs comma-separated integers >= {minimum}, got {text!r}")
    return values


# ------------------------------------------------------------------ replay lengths
def exact_replay(hit: int, layers: int, window: int) -> int:
    return min(hit, layers * (window - 1))


def bounded_replay(hit: int, window: int) -> int:
    return min(hit, window - 1)


# ------------------------------------------------------------------ 3. slot bytes
def mxfp8_bytes(values: int) -> int:
    """e4m3 bytes plus one scale byte per 32 values (rows padded to a whole block)."""
    return values + -(-values // MX_BLOCK)


def slot_bytes(layer_types: Sequence[str], cfg: dict[str, Any], fmt: str) -> dict[str, int]:
    """One sequence's SWA slot in our layout (``SWASlots``): per layer the raw window
    ``W x head_dim``; CSA layers add the compressor rings kv and gate ``2m x 2 head_dim`` and
    the indexer rings ``2m x 2 index_head_dim``; HCA layers add kv and gate ``m' x head_dim``.
    ``fmt``: ``bf16`` (2 bytes a value) or ``mxfp8`` (every row quantised on its own)."""
    from engine.config import CSA, HCA

    def rows(n: int, width: int) -> int:
        return n * (2 * width if fmt == "bf16" else mxfp8_bytes(width))

    if fmt not in ("bf16", "mxfp8"):
        raise ValueError(f"unknown format {fmt!r}")
    d, di, w = int(cfg["head_dim"]), int(cfg["index_head_dim"]), int(cfg["sliding_window"])
    m, mh = int(cfg.get("compress_rate_csa", 4)), int(cfg.get("compress_rate_hca", 128))
    window = compressor = indexer = 0
    for t in layer_types:
        window += rows(w, d)
        if t == CSA:
            compressor += 2 * rows(2 * m, 2 * d)
            indexer += 2 * rows(2 * m, 2 * di)
        elif t == HCA:
            compressor += 2 * rows(mh, d)
    return {
        "window": window,
        "compressor": compressor,
        "indexer": indexer,
        "total": window + compressor + indexer,
    }


def slot_bytes_report(kept: int = KEPT_LAYERS) -> dict[str, Any]:
    from engine.cache.spec import CacheSpec
    from engine.checkpoint.presets import preset_config
    from engine.config import CSA, HCA, SLIDING

    cfg = preset_config("flash-shape", num_hidden_layers=FLASH_LAYERS)
    types = list(cfg["layer_types"])[:kept]
    out: dict[str, Any] = {
        "shape": f"flash-shape preset resized to {FLASH_LAYERS} layers; the first {kept} kept",
        "head_dim": cfg["head_dim"],
        "index_head_dim": cfg["index_head_dim"],
        "window": cfg["sliding_window"],
        "kept_layers": {
            "count": kept,
            "sliding": types.count(SLIDING),
            "csa": types.count(CSA),
            "hca": types.count(HCA),
        },
    }
    for fmt in ("bf16", "mxfp8"):
        b = slot_bytes(types, cfg, fmt)
        out[fmt] = {**b, "window_only": b["window"]}
    # Cross-check the bf16 figure against the engine's own formula (CacheSpec at 2-byte elements).
    spec = CacheSpec(
        tuple(types), cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"], 4, 128, 2, 2
    )
    out["bf16"]["cache_spec_slot_bytes"] = spec.slot_bytes()
    out["deepseek"] = {
        "bytes": DEEPSEEK_SLOT_BYTES,
        "formula": f"{kept} layers x {DEEPSEEK_TOKENS_PER_LAYER} tokens x {mxfp8_bytes(512)} bytes",
    }
    out["mxfp8_window_only_vs_deepseek"] = out["mxfp8"]["window"] / DEEPSEEK_SLOT_BYTES
    out["mxfp8_total_vs_deepseek"] = out["mxfp8"]["total"] / DEEPSEEK_SLOT_BYTES
    return out


# ------------------------------------------------------------------ 2. trace accounting
def trace_accounting(
    blocks: Sequence[Sequence[int]],
    input_len: Sequence[int],
    block_size: int,
    layers: int,
    window: int,
    host_slots: Sequence[int] = (),
    key_rule: str = "full_blocks",
) -> dict[str, Any]:
    """Prefill tokens of requests replayed in order against an unbounded prefix cache.

    A block is cached once any earlier request had it. A request's hit is the tokens of its
    leading cached blocks, capped at ``input_len - 1`` (one token is always computed). A
    request computes ``input_len - hit`` tokens plus the replay of its policy:

    - ``exact``: ``min(hit, layers * (window - 1))``;
    - ``bounded``: ``min(hit, window - 1)``;
    - ``host[N]``: an LRU pool of N host slots; 0 when the pool holds a slot whose key is the
      request's leading cached block chain (``blocks[:k]`` for a hit of k blocks), else
      ``bounded``. After each request its slot is saved (most recently used), keyed by
      ``key_rule``: ``full_blocks`` = the chain of the request's full blocks
      (``blocks[:input_len // block_size]``: the state at the last block boundary of its
      prompt, which a later turn extending the prompt can use); ``full_chain`` = every
      hash id, the partial last block included (the state at the prompt's end). A slot used
      by a hit is refreshed too. Policies with N = 0 slots are bounded.
    """
    if key_rule not in ("full_blocks", "full_chain"):
        raise ValueError(f"unknown key rule {key_rule!r}")
    seen: set[int] = set()
    pools: list[OrderedDict[tuple[int, ...], None]] = [OrderedDict() for _ in host_slots]
    host_hits = [0] * len(host_slots)
    host_replay = [0] * len(host_slots)
    new = exact = bounded = 0
    hits = 0
    hit_tokens = 0
    total_input = 0
    for chain, n in zip(blocks, input_len):
        chain = tuple(int(b) for b in chain)
        n = int(n)
        k = 0
        for b in chain:
            if b not in seen:
                break
            k += 1
        hit = min(k * block_size, n - 1)
        total_input += n
        new += n - hit
        if hit > 0:
            hits += 1
            hit_tokens += hit
        exact += exact_replay(hit, layers, window)
        b_r = bounded_replay(hit, window)
        bounded += b_r
        key_hit = chain[:k]
        saved = chain[: n // block_size] if key_rule == "full_blocks" else chain
        for i, (pool, cap) in enumerate(zip(pools, host_slots)):
            if hit > 0 and key_hit in pool:
                host_hits[i] += 1
                pool.move_to_end(key_hit)
            else:
                host_replay[i] += b_r
            if cap > 0 and saved:
                pool[saved] = None
                pool.move_to_end(saved)
                while len(pool) > cap:
                    pool.popitem(last=False)
        seen.update(chain)
    out: dict[str, Any] = {
        "requests": len(input_len),
        "input_tokens": total_input,
        "hits": hits,
        "hit_tokens": hit_tokens,
        "computed_without_replay": new,
        "replay_tokens": {"exact": exact, "bounded": bounded},
        "prefill_tokens": {"exact": new + exact, "bounded": new + bounded},
        "host": [],
    }
    for cap, h, r in zip(host_slots, host_hits, host_replay):
        out["host"].append({"slots": cap, "slot_hits": h, "replay_tokens": r, "prefill_tokens": new + r})
    return out


def trace_report(path: Path, host_gib: Sequence[int], slot_size: int) -> dict[str, Any]:
    from router.trace import load_trace

    trace = load_trace(path)
    slots = [int(g * GIB // slot_size) for g in host_gib]
    res: dict[str, Any] = {"trace": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)}
    res["shape"] = {"layers": FLASH_LAYERS, "window": FLASH_WINDOW, "block_tokens": trace.block_size}
    res["exact_replay_cap"] = FLASH_LAYERS * (FLASH_WINDOW - 1)
    res["bounded_replay_cap"] = FLASH_WINDOW - 1
    res["host_slot_bytes"] = slot_size
    res["host_budgets"] = [{"gib": g, "bytes": g * GIB, "slots": s} for g, s in zip(host_gib, slots)]
    for rule in ("full_blocks", "full_chain"):
        acc = trace_accounting(
            trace.blocks, trace.input_len, trace.block_size, FLASH_LAYERS, FLASH_WINDOW, slots, rule
        )
        ex, bo = acc["prefill_tokens"]["exact"], acc["prefill_tokens"]["bounded"]
        acc["bounded_over_exact"] = bo / ex
        for h, g in zip(acc["host"], host_gib):
            h["gib"] = g
            h["host_over_exact"] = h["prefill_tokens"] / ex
        res[rule] = acc
    return res


# ------------------------------------------------------------------ 1. replay timing
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
    import torch

    from engine.config import BLOCK_TOKENS
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.runner import ModelRunner, RunnerConfig

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

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
        t0 = time.perf_counter()
        for s in range(0, hit, chunk):
            e = min(hit, s + chunk)
            runner.execute(
                ForwardBatch.from_sequences([SequenceInput(ids[s:e], s, 0, blocks, sample=False)], device)
            )
            progress(f"swa {label} ctx {hit}: prefill {e}/{hit} ({time.perf_counter() - t0:.0f} s)")
        sync()
        prefill_s = time.perf_counter() - t0
        lengths = {"exact": exact_replay(hit, layers, window), "bounded": bounded_replay(hit, window)}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in lengths}
        for rep in range(repeats):
            for policy in ("exact", "bounded") if rep % 2 == 0 else ("bounded", "exact"):
                r = lengths[policy]
                for t in runner.swa.slot_tensors(1):
                    t.zero_()
                sync()
                t1 = time.perf_counter()
                for s in range(hit - r, hit, chunk):
                    e = min(hit, s + chunk)
                    seq = SequenceInput(
                        ids[s:e], s, 1, blocks, sample=False, rows_cached_until=hit, window_from=hit - r
                    )
                    runner.execute(ForwardBatch.from_sequences([seq], device))
                sync()
                t2 = time.perf_counter()
                runner.execute(
                    ForwardBatch.from_sequences([SequenceInput([ids[hit]], hit, 1, blocks)], device)
                )
                sync()
                t3 = time.perf_counter()
                times[policy].append((t2 - t1, t3 - t2))
                progress(
                    f"swa {label} ctx {hit}: {policy} replay {r} tokens {t2 - t1:.2f} s + decode {t3 - t2:.3f} s"
                )
        row: dict[str, Any] = {"layers": layers, "window": window, "context": hit, "prefill_s": prefill_s}
        for policy, ts in times.items():
            row[f"{policy}_tokens"] = lengths[policy]
            row[f"{policy}_replay_s"] = statistics.median(a for a, _ in ts)
            row[f"{policy}_decode_s"] = statistics.median(b for _, b in ts)
            row[f"{policy}_s"] = statistics.median(a + b for a, b in ts)
            row[f"{policy}_min_s"] = min(a + b for a, b in ts)
            row[f"{policy}_all_s"] = [a + b for a, b in ts]
        row.update(time_fetch(runner, hit, repeats))
        row["fetch_over_bounded"] = row["fetch_s"] / row["bounded_s"]
        row["bounded_over_exact"] = row["bounded_s"] / row["exact_s"]
        # the fastest repeat of each: the least disturbed by other work on a shared machine
        row["bounded_over_exact_min"] = row["bounded_min_s"] / row["exact_min_s"]
        rows.append(row)
        del runner
    return rows


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


def timing_report(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.checkpoint.generate import generate_checkpoint

    out = []
    for layers in parse_ints(args.layers, "--layers"):
        with tempfile.TemporaryDirectory(prefix=f"sluice-swa-{layers}l-") as tmp:
            t0 = time.perf_counter()
            generate_checkpoint("small", tmp, seed=args.seed, num_hidden_layers=layers)
            progress(f"swa: generated small x {layers} layers in {time.perf_counter() - t0:.1f} s")
            out += time_replay(
                Path(tmp),
                parse_ints(args.contexts, "--contexts"),
                args.repeats,
                args.chunk,
                args.device,
                args.dtype,
                args.seed,
                f"{layers}L",
            )
    return out


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> Report:
    if args.repeats < 1 or args.chunk < 1:
        raise ValueError("--repeats and --chunk must be >= 1")
    host_gib = parse_ints(args.host_gib, "--host-gib", minimum=0)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = {
        "layers": args.layers,
        "contexts": args.contexts,
        "default_layers": DEFAULT_LAYERS,
        "default_contexts": DEFAULT_CONTEXTS,
        "repeats": args.repeats,
        "chunk": args.chunk,
        "device": args.device,
        "dtype": args.dtype,
        "preset": "small (widths), num_hidden_layers overridden",
        "timing": not args.no_timing,
        "trace": str(args.trace.relative_to(REPO) if args.trace.is_relative_to(REPO) else args.trace),
        "host_gib": host_gib,
    }
    report = Report("swa", config)
    t0 = time.perf_counter()
    sb = slot_bytes_report()
    report.results["slot_bytes"] = sb
    report.results["trace"] = trace_report(args.trace, host_gib, sb["mxfp8"]["total"])
    if not args.no_timing:
        timing = timing_report(args)
        report.results["timing"] = timing
        for r in timing:
            report.rows.append(
                {
                    "layers": r["layers"],
                    "context": r["context"],
                    "prefill s": round(r["prefill_s"], 2),
                    "exact r": r["exact_tokens"],
                    "exact s": round(r["exact_s"], 3),
                    "bounded r": r["bounded_tokens"],
                    "bounded s": round(r["bounded_s"], 3),
                    "bounded/exact": round(r["bounded_over_exact"], 4),
                    "min exact s": round(r["exact_min_s"], 3),
                    "min bounded s": round(r["bounded_min_s"], 3),
                    "bounded/exact (min)": round(r["bounded_over_exact_min"], 4),
                    "fetch s": round(r["fetch_s"], 4),
                    "fetch/bounded": round(r["fetch_over_bounded"], 4),
                }
            )
        cell = target_cell(timing)
        if cell is not None:
            name = f"bounded / exact replay time at {cell['context'] // 1024}K, {cell['layers']} layers"
            if (cell["layers"], cell["context"]) != (TARGET_LAYERS, TARGET_CONTEXT):
                name += " (the target's 16K x 43 layers was not run; largest cell run)"
            report.target(name, cell["bounded_over_exact"], "<=", TARGET_RATIO)
            name = name.replace("bounded / exact replay", "remote slot fetch / bounded replay")
            report.target(name, cell["fetch_over_bounded"], "<=", FETCH_TARGET_RATIO)
    tr = report.results["trace"]["full_blocks"]
    exact_tokens = tr["prefill_tokens"]["exact"]
    policies = [("exact", exact_tokens), ("bounded", tr["prefill_tokens"]["bounded"])]
    policies += [(f"host {h['gib']} GiB", h["prefill_tokens"]) for h in tr["host"]]
    for name, tokens in policies:
        report.rows.append(
            {"trace policy": name, "prefill tokens": tokens, "vs exact": round(tokens / exact_tokens, 4)}
        )
    report.results["wall_s"] = time.perf_counter() - t0
    return report


def target_cell(timing: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The 16K x 43-layer cell if it ran, else the one with the most layers at the longest context."""
    for r in timing:
        if (r["layers"], r["context"]) == (TARGET_LAYERS, TARGET_CONTEXT):
            return r
    return max(timing, key=lambda r: (r["layers"], r["context"]), default=None)


def main() -> None:
    """``python -m services.bench.swa`` (same as ``sluice bench swa``)."""
    module_main("swa", add_arguments, run, None)


if __name__ == "__main__":
    main()
