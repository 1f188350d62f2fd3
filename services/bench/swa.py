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
   loopback, gRPC, verified, written into slot 1), timed the same way (``time_fetch``).
2. ``trace``: prefill tokens on the Mooncake conversation trace at the V4-Flash shape
   (43 layers, W = 128) under an unbounded prefix cache, for exact replay, bounded replay and
   an LRU pool of host-memory slots (bounded replay when the pool misses). See
   ``_swa_accounting.trace_accounting`` for the hit and keying rules.
3. ``slot_bytes``: bytes of one sequence's SWA slot in our layout (``engine/cache/spec.py``)
   at the V4-Flash widths, in bf16 and MXFP8, beside DeepSeek's 1,415,040 bytes.

This module is the CLI (``add_arguments``, ``run``; ``timing_report`` drives part 1 over the
``--layers`` checkpoints). The replay timing and the slot fetch are in
``services/bench/_swa_timing.py``; the replay lengths, the trace accounting and the slot bytes,
pure, in ``services/bench/_swa_accounting.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress
from services.bench._swa_accounting import (  # noqa: F401  (all but REPO, the reports: re-exported for tests)
    DEEPSEEK_SLOT_BYTES,
    REPO,
    bounded_replay,
    exact_replay,
    mxfp8_bytes,
    slot_bytes,
    slot_bytes_report,
    trace_accounting,
    trace_report,
)
from services.bench._swa_timing import time_replay

DEFAULT_TRACE = REPO / "data/traces/conversation_trace.jsonl"
DEFAULT_LAYERS = "6,12,24,43"
DEFAULT_CONTEXTS = "4096,16384,65536"
TARGET_LAYERS, TARGET_CONTEXT, TARGET_RATIO = 43, 16384, 0.1
FETCH_TARGET_RATIO = 0.2  # a remote slot fetch against a bounded replay, same cell


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


# ------------------------------------------------------------------ 1. replay timing
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
