"""Routed experts from decode to prefill sizes: the grouped Triton kernel's two configurations
against torch's grouped GEMM (CUDA).

One MoE layer's two projections (gate/up, then down) at a preset's expert widths, for token
counts from one decode row to a long prefill chunk, each token routed to
``num_experts_per_tok`` experts drawn uniformly (seeded). Every kernel gets the same rows,
sorted by expert:

* ``torch``: ``torch._grouped_mm``;
* ``fixed``: the batch-invariant mode's fixed 64-row tiles (`engine.kernels.batch_invariant`);
* ``tuned``: the same kernel with `TUNED_GROUPED`'s tiles and program order.

Each time is the mean of ``--repeats`` back-to-back launches after one warm-up, by CUDA
events, and includes the tile map the kernel builds on the device. The floor is the bytes of
the experts that got at least one row, read once, over a device copy rate measured in the same
run. This is the measurement behind the engine's choice (`engine.model.experts`): each kernel
takes the band of rows per expert where it was the fastest.

``--sweep`` times every configuration of `sweep_space` (tiles, warps, stages, program order) at
``--sweep-tokens`` and reports the fastest: how `TUNED_GROUPED` was chosen.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from services.bench import Report, cuda_mean_ms, machine_info, module_main, progress

TOKENS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)


def sweep_space() -> list[tuple[int, int, int, int, int, bool]]:
    """(bm, bn, bk, warps, stages, columns_first) configurations of the sweep: row tiles of 64
    or 128, column tiles of 128 or 256, 4 or 8 warps (8 for the widest tiles), 3 or 4 stages,
    both program orders; and four others around them."""
    space = [
        (bm, bn, 64, warps, stages, first)
        for bm, bn, warps, stages, first in itertools.product(
            (64, 128), (128, 256), (4, 8), (3, 4), (False, True)
        )
        if not (bm * bn >= 128 * 256 and warps == 4)
    ]
    return space + [(128, 128, 128, 8, 3, True), (64, 128, 128, 4, 3, True), (128, 64, 64, 4, 4, True),
                    (64, 64, 64, 4, 3, False)]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="flash-shape", help="expert widths of this preset (default flash-shape)"
    )
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, a comma list")
    p.add_argument("--repeats", type=int, default=20, help="timed launches per cell (default 20)")
    p.add_argument("--sweep", action="store_true", help="also time every configuration of the sweep")
    p.add_argument("--sweep-tokens", default="4096,16384", help="token counts of the sweep (comma list)")


def _routed(e: int, k: int, tokens: int, d: int, inter: int, gen: Any) -> tuple[Any, Any, Any, int]:
    """Rows for ``tokens`` tokens of ``k`` uniform experts each: (x [R, d], h [R, inter],
    each expert group's end, experts hit)."""
    import torch

    rows = tokens * k
    ids = torch.randint(0, e, (rows,), device="cuda", generator=gen)
    counts = torch.bincount(ids, minlength=e)
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, h, torch.cumsum(counts, 0).to(torch.int32), int((counts > 0).sum())


def run(args: argparse.Namespace) -> Report:
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.kernels import triton_available
    from engine.model.experts import GROUPED_GEMMS
    from services.bench._engine_decode import copy_bandwidth

    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("sluice bench moe needs a CUDA device with Triton")
    cfg = preset_config(args.preset)
    e, d, inter, k = (
        cfg[n] for n in ("n_routed_experts", "hidden_size", "moe_intermediate_size", "num_experts_per_tok")
    )
    report = Report("moe", {"preset": args.preset, "experts": e, "hidden": d, "intermediate": inter,
                            "per_token": k, "repeats": args.repeats, "sweep": args.sweep,
                            "machine": machine_info()})  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(e, 2 * inter, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, d, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    bw = copy_bandwidth("cuda")

    def layer_ms(f: Any, x: Any, h: Any, ends: Any) -> tuple[float, float]:
        return (
            cuda_mean_ms(lambda: f(x, gate_up, ends), args.repeats),
            cuda_mean_ms(lambda: f(h, down, ends), args.repeats),
        )

    rows_out: list[dict[str, Any]] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, h, ends, hit = _routed(e, k, tokens, d, inter, gen)
        t = {n: layer_ms(f, x, h, ends) for n, f in GROUPED_GEMMS.items()}
        total = {n: sum(v) for n, v in t.items()}
        floor = hit * 3 * inter * d * 2 / bw * 1e3
        row: dict[str, Any] = {
            "tokens": tokens,
            "rows_per_expert": round(tokens * k / e, 2),
            "experts_hit": hit,
        }
        for n, (gu, dn) in t.items():
            row.update({f"{n}_gate_up ms": round(gu, 3), f"{n}_down ms": round(dn, 3)})
        row.update({
            **{f"{n} ms": round(v, 3) for n, v in total.items()},
            "floor ms": round(floor, 3), "fastest": min(total, key=total.__getitem__),
        })  # fmt: skip
        rows_out.append(row)
        report.rows.append(row)
        progress(f"moe: {tokens} tokens: " + ", ".join(f"{n} {v:.3f} ms" for n, v in total.items()))
        del x, h
    results: dict[str, Any] = {"copy_bandwidth_Bps": bw, "cells": rows_out, "method": __doc__}
    if args.sweep:
        results["sweep"] = _sweep(args, e, k, d, inter, gate_up, down, bw, layer_ms, gen)
    report.results = results
    return report


def _sweep(args: argparse.Namespace, e: int, k: int, d: int, inter: int, gate_up: Any, down: Any,
           bw: float, layer_ms: Any, gen: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Every `sweep_space` configuration at each sweep token count, fastest first, beside torch."""
    from engine.kernels.grouped import GroupedTiles, grouped_matmul
    from engine.model.experts import torch_grouped_matmul

    cells = []
    for tokens in (int(t) for t in args.sweep_tokens.split(",")):
        x, h, ends, hit = _routed(e, k, tokens, d, inter, gen)
        torch_ms = sum(layer_ms(torch_grouped_matmul, x, h, ends))
        timed = []
        for bm, bn, bk, warps, stages, first in sweep_space():
            tiles = GroupedTiles(bm, bn, bk, warps, stages, first)
            try:
                ms = sum(layer_ms(lambda a, w, en, c=tiles: grouped_matmul(a, w, en, c), x, h, ends))
            except Exception as err:  # a configuration past the GPU's shared memory  # noqa: BLE001
                progress(f"moe sweep: {tiles} skipped ({type(err).__name__})")
                continue
            timed.append({"tiles": [bm, bn, bk], "warps": warps, "stages": stages,
                          "columns_first": first, "ms": round(ms, 3)})  # fmt: skip
        timed.sort(key=lambda c: c["ms"])
        floor = hit * 3 * inter * d * 2 / bw * 1e3
        best = timed[0] if timed else None
        progress(f"moe sweep: {tokens} tokens: torch {torch_ms:.3f} ms, fastest {best}")
        cells.append({"tokens": tokens, "rows_per_expert": round(tokens * k / e, 2), "torch ms": round(torch_ms, 3),
                      "floor ms": round(floor, 3), "configs": timed})  # fmt: skip
        del x, h
    return cells


def main() -> None:
    """``python -m services.bench.moe`` (same as ``sluice bench moe``)."""
    module_main("moe", add_arguments, run, None)


if __name__ == "__main__":
    main()
