"""mHC's mixing weights (`engine.kernels.hyper.hc_weights`: the premix and the pre / post /
Sinkhorn finish) at a preset's widths, per slice count of the premix (CUDA).

The premix cuts the reduced width ``n * D`` into slices (`PREMIX_SLICES`, each at least
`PREMIX_MIN_SLICE` wide): a decode step's handful of rows fill the GPU through the slices, a
prefill step's thousands through the rows, and each slice adds a partial row the finish
reads. A function of ``n * D`` alone, so a row's sums never depend on its batch. Seeded
random bf16 streams, fp32 ``fn``; each time is one CUDA-graph replay of ``--repeats`` calls
after a warm-up, by CUDA events, over ``--repeats``, at 1, 64, 256 and 4,096 rows (a graph,
because back-to-back eager calls measure the host's launches, ~80-130 us a call, not the
kernels: the first H200 run of this bench timed them eagerly and showed only that). The engine's setting is written into
the code (the GPU machine keeps nothing between runs).

``--device cpu``: the CPU's eager Sinkhorn (`engine.model.hyper.sinkhorn_eager`, 4 x 4
matrices, 20 iterations) through torch and through numpy (`_sinkhorn_numpy`) at 1 to 256
rows, alternating per row count, the median of ``--repeats`` calls each, and whether the two
results are bitwise equal: where numpy stops winning is where the engine's
`NUMPY_SINKHORN_ELEMENTS` should sit.
"""

from __future__ import annotations

import argparse

from services.bench import Report, cuda_mean_ms, module_main, progress

CANDIDATES = ((8, 1024), (16, 1024), (32, 512), (64, 256))  # (slices, minimum slice width)
ROWS = (1, 64, 256, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="flash-shape", help="hidden size and hc_mult of this preset")
    p.add_argument("--repeats", type=int, default=20, help="timed launches per cell (default 20)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the eager Sinkhorn's A/B")


SINKHORN_ROWS = (1, 4, 16, 32, 64, 96, 128, 256)


def _cpu_sinkhorn(args: argparse.Namespace) -> Report:
    import statistics
    import time

    import torch

    from engine.model import hyper

    report = Report("hyper", {"device": "cpu", "repeats": args.repeats, "threads": torch.get_num_threads()})
    g = torch.Generator().manual_seed(0)
    limit = hyper.NUMPY_SINKHORN_ELEMENTS
    try:  # the threshold picks the path: -1 the torch loop, the matrix's size numpy
        for rows in SINKHORN_ROWS:
            comb = torch.softmax(torch.randn(rows, 4, 4, generator=g), dim=-1) + 1e-6
            times: dict[str, list[float]] = {"torch": [], "numpy": []}
            for _ in range(args.repeats):
                for name, lim in (("torch", -1), ("numpy", comb.numel())):
                    hyper.NUMPY_SINKHORN_ELEMENTS = lim
                    t = time.perf_counter()
                    hyper.sinkhorn_eager(comb, 20, 1e-6)
                    times[name].append(time.perf_counter() - t)
            hyper.NUMPY_SINKHORN_ELEMENTS = -1
            row = {
                "rows": rows, "elements": comb.numel(),
                "torch us": round(statistics.median(times["torch"]) * 1e6, 1),
                "numpy us": round(statistics.median(times["numpy"]) * 1e6, 1),
                "engine takes": "numpy" if comb.numel() <= limit else "torch",
                "bitwise equal": torch.equal(hyper.sinkhorn_eager(comb, 20, 1e-6), hyper._sinkhorn_numpy(comb, 20, 1e-6)),
            }  # fmt: skip
            report.rows.append(row)
            progress(f"hyper: cpu sinkhorn {row}")
    finally:
        hyper.NUMPY_SINKHORN_ELEMENTS = limit
    report.results["cpu_sinkhorn"] = report.rows
    return report


def run(args: argparse.Namespace) -> Report:
    if args.device == "cpu":
        return _cpu_sinkhorn(args)
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.kernels import hyper, triton_available

    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("sluice bench hyper needs a CUDA device with Triton")
    cfg = preset_config(args.preset)
    n, d = cfg["hc_mult"], cfg["hidden_size"]
    m = (2 + n) * n
    report = Report("hyper", {"preset": args.preset, "hc_mult": n, "hidden": d, "repeats": args.repeats})
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(m, n * d, device="cuda", generator=g)
    base, scale = torch.randn(m, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
    streams = {t: torch.randn(t, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for t in ROWS}
    chosen = (hyper.PREMIX_SLICES, hyper.PREMIX_MIN_SLICE)
    try:
        for slices, width in CANDIDATES:
            hyper.PREMIX_SLICES, hyper.PREMIX_MIN_SLICE = slices, width
            row: dict = {"slices": slices, "min width": width, "engine": (slices, width) == chosen}
            for t, x in streams.items():
                us = _graph_us(lambda x=x: hyper.hc_weights(x, fn, base, scale, 1e-6, 1e-6, 20), args.repeats)
                row[f"us at {t} rows"] = round(us, 1)
            report.rows.append(row)
            progress(f"hyper: {slices} slices: {row}")
    finally:
        hyper.PREMIX_SLICES, hyper.PREMIX_MIN_SLICE = chosen
    report.results["premix_slices"] = report.rows
    return report


def _graph_us(fn, repeats: int) -> float:
    """Mean us per call of ``fn`` captured ``repeats`` times in one CUDA graph (one replay)."""
    import torch

    for _ in range(3):  # compiles, caches
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return 1e3 * cuda_mean_ms(graph.replay, 1) / repeats


def main() -> None:
    """``python -m services.bench.hyper`` (same as ``sluice bench hyper``)."""
    module_main("hyper", add_arguments, run, None)


if __name__ == "__main__":
    main()
