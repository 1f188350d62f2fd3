"""Routed experts at decode sizes: the fixed-tile Triton grouped kernel against torch's grouped GEMM (CUDA).

One MoE layer's two projections (gate/up, then down) at a preset's expert widths, for token
counts from one decode row to a prefill chunk, each token routed to ``num_experts_per_tok``
experts drawn uniformly (seeded). Both kernels get the same rows, sorted by expert. Each time
is the mean of ``--repeats`` back-to-back launches after one warm-up, by CUDA events. The
floor is the bytes of the experts that got at least one row, read once, over a device copy
rate measured in the same run. This is the measurement behind the engine's choice
(`engine.model.moe`): the Triton kernel for batches of at most one 64-row tile per expert on
average, torch's grouped GEMM above.
"""

from __future__ import annotations

import argparse
from typing import Any

from services.bench import Report, cuda_mean_ms, machine_info, module_main, progress

TOKENS = (1, 16, 64, 256, 1024, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="flash-shape", help="expert widths of this preset (default flash-shape)"
    )
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, a comma list")
    p.add_argument("--repeats", type=int, default=20, help="timed launches per cell (default 20)")


def run(args: argparse.Namespace) -> Report:
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.kernels import batch_invariant, triton_available
    from engine.model.moe import torch_grouped_matmul
    from services.bench._engine_decode import copy_bandwidth

    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("sluice bench moe needs a CUDA device with Triton")
    cfg = preset_config(args.preset)
    e, d, inter, k = (
        cfg[n] for n in ("n_routed_experts", "hidden_size", "moe_intermediate_size", "num_experts_per_tok")
    )
    report = Report("moe", {"preset": args.preset, "experts": e, "hidden": d, "intermediate": inter,
                            "per_token": k, "repeats": args.repeats, "machine": machine_info()})  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(e, 2 * inter, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, d, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    bw = copy_bandwidth("cuda")
    rows_out: list[dict[str, Any]] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = tokens * k
        ids = torch.randint(0, e, (rows,), device="cuda", generator=gen)
        counts = torch.bincount(ids, minlength=e)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16, generator=gen)
        calls = {
            "torch_gate_up": (torch_grouped_matmul, x, gate_up),
            "triton_gate_up": (batch_invariant.grouped_matmul, x, gate_up),
            "torch_down": (torch_grouped_matmul, h, down),
            "triton_down": (batch_invariant.grouped_matmul, h, down),
        }
        t = {
            n: cuda_mean_ms(lambda f=f, a=a, w=w, e=ends: f(a, w, e), args.repeats)
            for n, (f, a, w) in calls.items()
        }
        hit = int((counts > 0).sum())
        floor = hit * 3 * inter * d * 2 / bw * 1e3
        row = {
            "tokens": tokens, "rows_per_expert": round(rows / e, 2), "experts_hit": hit,
            **{f"{n} ms": round(v, 3) for n, v in t.items()},
            "floor ms": round(floor, 3),
            "torch / triton": round((t["torch_gate_up"] + t["torch_down"]) / (t["triton_gate_up"] + t["triton_down"]), 2),
        }  # fmt: skip
        rows_out.append(row)
        report.rows.append(row)
        progress(f"moe: {tokens} tokens: torch {t['torch_gate_up'] + t['torch_down']:.3f} ms, "
                 f"triton {t['triton_gate_up'] + t['triton_down']:.3f} ms")  # fmt: skip
    report.results = {"copy_bandwidth_Bps": bw, "cells": rows_out, "method": __doc__}
    return report


def main() -> None:
    """``python -m services.bench.moe`` (same as ``sluice bench moe``)."""
    module_main("moe", add_arguments, run, None)


if __name__ == "__main__":
    main()
