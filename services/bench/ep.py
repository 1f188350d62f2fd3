"""Expert parallelism: prefill and decode tokens/s per GPU at EP1 (one device, every expert)
and EPn/DPn (n processes, experts split, all-to-all over NCCL or gloo), scaling efficiency
(per-GPU throughput EPn / EP1), and EPLB live at EPn with the prefill settings (imbalance =
slowest rank / mean tokens received, before and after a remap done while serving; remap cost).

Weights are seeded random values drawn on the device (`ModelRunner.random`): throughput does
not depend on their values, and it spares writing/reading ~13 GB of experts per flash-shape
layer. Routing is therefore a random router on Zipf-distributed token ids, not a trained
model's; the imbalance figures are measured on that traffic.

On CPU (``--device cpu --preset tiny``) the same code runs over gloo, for testing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress

DEEPSEEK_IMBALANCE = {2: 1.045, 4: 1.074, 8: 1.090}  # the reference figures per EP size
SCALING_TARGET = 0.8


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--preset", default="flash-shape", help="gen-checkpoint preset for the widths")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (2: one hash-MoE, one CSA layer)")
    p.add_argument("--experts", type=int, help="override n_routed_experts (default: the preset's)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--ep", default="1,2", help="EP sizes to run; 1 is the single-device baseline")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="prefill tokens per rank per step")
    p.add_argument("--prefill-seqs", type=int, default=2, help="sequences per prefill step")
    p.add_argument("--decode-batches", default="64,128,256", help="decode requests per rank")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens before decoding")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=5, help="timed prefill steps")
    p.add_argument("--eplb-steps", type=int, default=12, help="prefill steps with EPLB live (0: off)")
    p.add_argument("--eplb-window", type=int, default=4, help="EPLB window (steps); DeepSeek's is longer")
    p.add_argument("--eplb-period", type=int, default=8, help="EPLB period (steps)")
    p.add_argument("--eplb-redundant", type=int, default=4, help="redundant experts per rank")
    p.add_argument("--zipf", type=float, default=1.1, help="token-id skew of the traffic (0: uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=480.0, help="seconds for each EP size's processes")


def _worker_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.prefill_tokens % args.prefill_seqs:
        raise ValueError("--prefill-tokens must be a multiple of --prefill-seqs")
    return {
        "device": args.device, "preset": args.preset, "layers": args.layers, "experts": args.experts,
        "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        "prefill_tokens": args.prefill_tokens, "prefill_seqs": args.prefill_seqs,
        "decode_batches": list(_ints(args.decode_batches)), "decode_context": args.decode_context,
        "decode_steps": args.decode_steps, "warmup": args.warmup, "repeats": args.repeats,
        "eplb_steps": args.eplb_steps, "eplb_window": args.eplb_window, "eplb_period": args.eplb_period,
        "eplb_redundant": args.eplb_redundant, "zipf": args.zipf, "seed": args.seed,
    }  # fmt: skip


def _spawn(world: int, wargs: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from engine.distributed.rendezvous import rendezvous_file
    from services.bench._ep_worker import worker

    ctx = mp.get_context("spawn")
    store = rendezvous_file()  # the ranks' rendezvous, held until they are done
    procs = [ctx.Process(target=worker, args=(r, world, store.path, wargs, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if alive or codes != [0] * world:
        raise RuntimeError(f"EP{world} workers failed (exit codes {codes}; {len(alive)} killed on timeout)")
    return json.loads((out / f"ep{world}.json").read_text())


def _targets(report: Report, runs: dict[int, dict[str, Any]]) -> None:
    base = runs.get(1)
    for world, res in sorted(runs.items()):
        if world == 1:
            continue
        tp = res["throughput"]
        if base is not None:
            b = base["throughput"]
            eff = tp["prefill"]["tok_per_s_per_gpu"] / b["prefill"]["tok_per_s_per_gpu"]
            report.results[f"ep{world}_prefill_scaling"] = eff
            report.target(
                f"EP{world} prefill scaling: tok_per_s_per_gpu EP{world} / EP1", eff, ">=", SCALING_TARGET
            )
            for d, d1 in zip(tp["decode"], b["decode"]):
                eff = d["tok_per_s_per_gpu"] / d1["tok_per_s_per_gpu"]
                n = d["requests_per_rank"]
                report.results[f"ep{world}_decode{n}_scaling"] = eff
                report.target(
                    f"EP{world} decode {n} req/rank scaling: tok_per_s_per_gpu EP{world} / EP1", eff, ">=",
                    SCALING_TARGET,
                )  # fmt: skip
        ep = res.get("eplb")
        if ep and ep["imbalance_after"] is not None and world in DEEPSEEK_IMBALANCE:
            report.target(
                f"EP{world} EPLB imbalance after remap (slowest rank / mean) vs DeepSeek's",
                ep["imbalance_after"], "<=", DEEPSEEK_IMBALANCE[world],
            )  # fmt: skip


def _rows(report: Report, runs: dict[int, dict[str, Any]]) -> None:
    for world, res in sorted(runs.items()):
        tp = res["throughput"]
        row: dict[str, Any] = {"ep": world, "prefill_tok_s_gpu": tp["prefill"]["tok_per_s_per_gpu"]}
        for d in tp["decode"]:
            row[f"decode{d['requests_per_rank']}_tok_s_gpu"] = d["tok_per_s_per_gpu"]
        if "eplb" in res:
            row["imb_before"] = res["eplb"]["imbalance_before"]
            row["imb_after"] = res["eplb"]["imbalance_after"]
            row["remap_ms"] = (res["eplb"]["remap_ms_each"] or [None])[0]
        report.rows.append(row)


def run(args: argparse.Namespace) -> Report:
    wargs = _worker_args(args)
    worlds = _ints(args.ep)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(worlds):
            raise ValueError(
                f"--ep {args.ep} needs {max(worlds)} CUDA devices, found {torch.cuda.device_count()}"
            )
    report = Report("ep", config={**wargs, "ep": list(worlds), "dispatch": "torch.distributed all_to_all_single",
                                  "weights": "seeded random, drawn on device"})  # fmt: skip
    runs: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-ep-") as tmp:
        for world in worlds:
            progress(f"EP{world}: starting {world} process(es) on {args.device}")
            runs[world] = _spawn(world, wargs, Path(tmp), args.timeout)
    report.results.update({f"ep{w}": r for w, r in runs.items()})
    _targets(report, runs)
    _rows(report, runs)
    return report


def main() -> None:
    """``python -m services.bench.ep`` (same as ``sluice bench ep``)."""
    module_main("ep", add_arguments, run, None)


if __name__ == "__main__":
    main()
