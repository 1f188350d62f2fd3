"""FP8 block-scaled products at a preset's widths (CUDA): bf16 weights (torch), FP8 weights
with bf16 activations (``w8a16``, our kernel), and FP8 weights with activations quantised
per 1 x 128 block (``w8a8``: our kernel, and torch's block-scaled GEMM for the dense cases).

Cases (flash-shape widths by default): the routed experts' two projections at a 4,096-token
prefill (``--prefill-rows`` rows spread evenly over the experts; 6 of 256 experts per token:
96 rows each) and at a 64-request decode step (2 rows each), and the attention and shared
expert's dense projections at 4,096 rows and at 64. Weights are seeded random values (std
0.05) quantised with DeepSeek's 128 x 128 ue8m0 block scales; activations are seeded random
bf16. Each time is the mean of ``--repeats`` back-to-back calls after a warm-up, by CUDA
events (`cuda_mean_ms`): the host queues ahead, so per-call launch costs are hidden as they
are in the engine's CUDA graphs. ``--sweep`` times the w8a8 kernel's tiles; the engine's
(`engine.kernels.fp8.A8_BM` and its neighbours) are written into the code, as the GPU machine
keeps nothing between runs. ``torch block`` is ``torch.nn.functional.scaled_mm`` with
BlockWise1x128 x BlockWise128x128 scales (cuBLASLt), reported with its relative error
against the same quantised values multiplied in fp32.
"""

from __future__ import annotations

import argparse
import itertools

from services.bench import Report, cuda_mean_ms, module_main, progress

SWEEP = {"A8_BM": (64, 128), "A8_BN": (64, 128, 256), "A8_WARPS": (4, 8), "A8_STAGES": (3, 4)}
# set with A8_BN and A8_WARPS in a sweep cell, so that every product runs the cell's tiles
WIDE = {"A8_WIDE_BN": "A8_BN", "A8_WIDE_WARPS": "A8_WARPS"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="flash-shape", help="widths of this preset")
    p.add_argument(
        "--prefill-rows", type=int, default=4096, help="tokens of the prefill cases (default 4096)"
    )
    p.add_argument("--decode-rows", type=int, default=64, help="requests of the decode cases (default 64)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per cell (default 20)")
    p.add_argument("--sweep", action="store_true", help="time every w8a8 tile configuration of the grid")


def _cases(cfg: dict, prefill: int, decode: int) -> list[tuple[str, int, int, int, int]]:
    """(name, experts, rows, N, K): experts > 1 are grouped products, rows spread evenly."""
    d, e, k = cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    inter, ql, hd = (
        cfg["moe_intermediate_size"],
        cfg["q_lora_rank"],
        cfg["num_attention_heads"] * cfg["head_dim"],
    )
    o = cfg["o_groups"] * cfg["o_lora_rank"]
    return [
        ("experts gate_up, prefill", e, prefill * k, 2 * inter, d),
        ("experts down, prefill", e, prefill * k, d, inter),
        ("experts gate_up, decode", e, decode * k, 2 * inter, d),
        ("q_a, prefill", 1, prefill, ql, d),
        ("q_b, prefill", 1, prefill, hd, ql),
        ("o_b, prefill", 1, prefill, d, o),
        ("shared gate_up, prefill", 1, prefill, 2 * inter, d),
        ("q_b, decode", 1, decode, hd, ql),
    ]


def run(args: argparse.Namespace) -> Report:
    import torch

    from engine.checkpoint.presets import preset_config
    from engine.kernels import fp8, triton_available

    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("sluice bench fp8 needs a CUDA device with Triton")
    cfg = preset_config(args.preset)
    report = Report(
        "fp8", {"preset": args.preset, "prefill_rows": args.prefill_rows, "decode_rows": args.decode_rows}
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    chosen = {k: getattr(fp8, k) for k in (*SWEEP, *WIDE)}
    sweep: list[dict] = []
    try:
        for case in _cases(cfg, args.prefill_rows, args.decode_rows):
            row = _case(case, g, args.repeats, sweep if args.sweep else None, chosen)
            report.rows.append(row)
            progress(f"fp8: {case[0]}: {row}")
    finally:
        fp8.set_compute("w8a16")
        for key, v in chosen.items():
            setattr(fp8, key, v)
    report.results["tiles"] = chosen
    if sweep:
        report.results["sweep"] = sweep
    return report


def _case(
    case: tuple[str, int, int, int, int], g, repeats: int, sweep: list[dict] | None, chosen: dict
) -> dict:
    """One product's row (and its sweep cells, appended to ``sweep``)."""
    import torch

    from engine.checkpoint.quant import dequantize, quantize_fp8
    from engine.kernels import fp8
    from engine.model.experts import torch_grouped_matmul

    name, e, rows, n, k = case
    w = torch.randn(e, n, k, device="cuda", generator=g) * 0.05
    parts = [quantize_fp8(w[i]) for i in range(e)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    wb = w.to(torch.bfloat16)
    del w, parts
    rows = e * -(-rows // e)  # whole rows per expert (decode: 384 rows -> 2 per expert)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    ends = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (rows // e)

    def ms(fn) -> float:
        return round(cuda_mean_ms(fn, repeats), 4)

    row: dict = {"case": name, "experts": e, "rows": rows, "N": n, "K": k}
    row["bf16 ms"] = ms(lambda: x @ wb[0].T) if e == 1 else ms(lambda: torch_grouped_matmul(x, wb, ends))
    fp8.set_compute("w8a16")
    row["w8a16 ms"] = ms(lambda: fp8.grouped_matmul(x, q, s, ends))
    fp8.set_compute("w8a8")
    row["w8a8 kernel ms"] = ms(lambda: fp8.w8a8_grouped_matmul(x, q, s, ends))
    row["engine takes"] = "w8a8 kernel"
    if e == 1 and hasattr(torch.nn.functional, "scaled_mm"):
        ref = fp8.fake_quantize_rows(x).float() @ dequantize(q[0], s[0]).T
        got = fp8.torch_block_linear(x, q[0], s[0]).float()
        row["torch block ms"] = ms(lambda: fp8.torch_block_linear(x, q[0], s[0]))
        row["torch block rel err"] = float(f"{((got - ref).norm() / ref.norm()).item():.2e}")
        if fp8.torch_block_pays(x, n):
            row["engine takes"] = "torch block"
    row["w8a8 (engine) / bf16"] = round(row[f"{row['engine takes']} ms"] / row["bf16 ms"], 3)
    if sweep is not None:
        for values in itertools.product(*SWEEP.values()):
            for key, v in zip(SWEEP, values):
                setattr(fp8, key, v)
            for wide, key in WIDE.items():
                setattr(fp8, wide, getattr(fp8, key))
            try:
                cell = {"ms": ms(lambda: fp8.w8a8_grouped_matmul(x, q, s, ends))}
            except Exception as exc:  # noqa: BLE001 - a configuration the GPU cannot run
                cell = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            sweep.append({"case": name, **dict(zip(SWEEP, values)), **cell})
        for key, v in chosen.items():
            setattr(fp8, key, v)
    fp8.set_compute("w8a16")
    return row


def main() -> None:
    """``python -m services.bench.fp8`` (same as ``sluice bench fp8``)."""
    module_main("fp8", add_arguments, run, None)


if __name__ == "__main__":
    main()
