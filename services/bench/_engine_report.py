"""`sluice bench engine --preset P`: the real-width report. The process-wide switches the
flags set (kernels, the experts' GEMM, the pooling kernel, the CPU's head), then the decode
part (`services/bench/_engine_decode.py`: tokens/s beside the memory roofline and
transformers) and the prefill part (`services/bench/_engine_prefill.py`: beside the compute
roofline and transformers, a long prompt), each turned into the report's rows and targets."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from services.bench import Report


def preset_report(args: argparse.Namespace, report: Report) -> None:
    """``--preset``: set the switches (recorded in the config), then run ``--parts``."""
    from engine.kernels import pooling, set_kernels
    from engine.model import packed_linear
    from engine.model.experts import force_experts_gemm

    set_kernels(not args.no_kernels)  # process-wide, as the bench runs one configuration
    force_experts_gemm(args.experts_gemm)
    packed_linear.PACKED = args.cpu_head == "packed"
    if args.pooling_kernel in ("on", "off"):
        pooling.FUSED_POOLING = args.pooling_kernel == "on"
    report.config.update({
        "kernels": not args.no_kernels, "experts_gemm": args.experts_gemm,
        "pooling_kernel": pooling.FUSED_POOLING, "cpu_head": args.cpu_head,
    })  # fmt: skip
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if unknown := parts - {"decode", "prefill"}:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; known: decode, prefill")
    if "decode" in parts:
        _decode(args, report)
    if "prefill" in parts:
        _prefill(args, report)


def _quant(args: argparse.Namespace) -> dict[str, Any]:
    """``--quant`` as the decode and prefill parts' ``fp8`` / ``fp8_compute`` fields."""
    return {"fp8": args.quant != "none", "fp8_compute": "w8a8" if args.quant == "fp8-w8a8" else "w8a16"}


def _decode(args: argparse.Namespace, report: Report) -> None:
    """The decode report (``--preset``) and its targets: fractions of the memory roofline
    (CUDA) and speedups over transformers at the same batch and context."""
    from services.bench._engine_decode import DecodeArgs, decode_report

    cuda = args.device.startswith("cuda")
    a = DecodeArgs(
        device=args.device, dtype=args.dtype or ("bfloat16" if cuda else "float32"), preset=args.preset,
        layers=tuple(int(x) for x in args.layers.split(",")),
        batches=tuple(int(x) for x in (args.decode_batches or ("1,16,64,256" if cuda else "1,16")).split(",")),
        context=args.context or (4096 if cuda else 128), tf_context=args.tf_context, steps=args.steps,
        transformers=not args.no_transformers, seed=0, decode_graphs=args.decode_graphs,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        pipeline_steps={"auto": None, "on": True, "off": False}[args.pipeline_steps],
        batch_invariant=args.batch_invariant, sampling=args.sampling,
        rounds=args.decode_rounds or (1 if cuda else 3), **_quant(args),
    )  # fmt: skip
    report.config.update({"decode": a.__dict__})
    with tempfile.TemporaryDirectory(prefix="sluice-bench-decode-") as tmp:
        out = decode_report(a, Path(tmp))
    report.results["decode"] = out
    for r in out["engine"]:
        report.rows.append({
            "part": f"sluice decode, {r['layers']} layers", "batch": r["batch"], "context": r["context"],
            "ms/step": round(r["ms_per_step"], 3), "tok/s": round(r["tokens_per_s"], 1),
            "roofline ms": round(r["roofline_ms"], 3), "of roofline": round(r["fraction_of_roofline"], 3),
        })  # fmt: skip
    for r in out["engine_at_tf_context"]:
        report.rows.append({
            "part": f"sluice decode, {r['layers']} layers", "batch": r["batch"], "context": r["context"],
            "ms/step": round(r["ms_per_step"], 3), "tok/s": round(r["tokens_per_s"], 1),
        })  # fmt: skip
    for t in out["transformers"]:
        report.rows.append({
            "part": "transformers decode", "batch": t["batch"], "context": t.get("context"),
            "ms/step": round(t["ms_per_step"], 3) if "ms_per_step" in t else t.get("error"),
            "tok/s": round(t["tokens_per_s"], 1) if "tokens_per_s" in t else "",
        })  # fmt: skip
    for v in out["versus_transformers"]:
        for p in v["rounds"][1:]:
            report.rows.append({
                "part": f"round {p['round'] + 1}: sluice / transformers ms/step", "batch": p["batch"],
                "context": v["context"], "ms/step": f"{p['sluice_ms']:.3f} / {p['transformers_ms']:.3f}",
            })  # fmt: skip
    first = [r for r in out["engine"] if r["layers"] == a.layers[0]]
    if cuda:
        for r in first:
            if r["batch"] == 1:
                report.target(
                    "decode at batch 1: fraction of the memory roofline",
                    r["fraction_of_roofline"],
                    ">=",
                    0.30,
                )
            if r["batch"] >= 64:
                report.target(
                    f"decode at batch {r['batch']}: fraction of the memory roofline",
                    r["fraction_of_roofline"],
                    ">=",
                    0.50,
                )
    bars = {1: 5.0, 64: 2.5} if cuda else {16: 1.5}
    for v in out["versus_transformers"]:
        if v["batch"] in bars:
            report.target(
                f"decode at batch {v['batch']}, context {v['context']}: sluice / transformers tokens/s",
                v["speedup"], ">=", bars[v["batch"]],
            )  # fmt: skip


def _prefill(args: argparse.Namespace, report: Report) -> None:
    """The prefill report (``--preset``) and its targets: the fraction of the compute roofline
    and the speedup over transformers at 4,096 tokens, the long prompt's peak memory."""
    from engine.checkpoint.generate import write_config_dir
    from services.bench._engine_prefill import PrefillArgs, prefill_report

    cuda = args.device.startswith("cuda")
    layers = int(args.layers.split(",")[0])
    tokens = tuple(int(x) for x in (args.prefill_tokens or ("4096,16384" if cuda else "256")).split(","))
    a = PrefillArgs(
        device=args.device, dtype=args.dtype or ("bfloat16" if cuda else "float32"), preset=args.preset,
        layers=layers, tokens=tokens, repeats=args.prefill_repeats, transformers=not args.no_transformers,
        tf_tokens=tokens[0], long_context=args.long_context if args.long_context is not None else (131072 if cuda else 0),
        long_chunk=args.long_chunk, host_profile=args.host_profile,
        ab_rounds=args.ab_rounds if args.pooling_kernel == "ab" else 0, **_quant(args),
    )  # fmt: skip
    report.config.update({"prefill": a.__dict__})
    with tempfile.TemporaryDirectory(prefix="sluice-bench-prefill-") as tmp:
        model_dir = write_config_dir(a.preset, Path(tmp) / a.preset, seed=a.seed, num_hidden_layers=layers)
        out = prefill_report(a, model_dir)
    report.results["prefill"] = out
    for r in out["engine"]:
        report.rows.append({
            "part": f"sluice prefill, {r['layers']} layers", "tokens": r["tokens"], "ms": round(r["ms"], 2),
            "host ms": round(r["host_ms"], 2), "tok/s": round(r["tokens_per_s"]), "roofline ms": round(r["roofline_ms"], 2),
            "of roofline": round(r["fraction_of_roofline"], 3),
        })  # fmt: skip
    tf = out["transformers"]
    if tf is not None:
        report.rows.append({
            "part": "transformers prefill", "tokens": tf["tokens"],
            "ms": round(tf["ms"], 2) if "ms" in tf else tf.get("error"),
            "tok/s": round(tf["tokens_per_s"]) if "ms" in tf else "",
        })  # fmt: skip
    long = out["long_context"]
    if long is not None:
        report.rows.append({
            "part": f"long prompt, first pass (compiles), chunks of {long['chunk']}", "tokens": long["tokens"],
            "ms": round(long["first_pass_s"] * 1e3),
        })  # fmt: skip
        for m in long["marks"]:
            report.rows.append({
                "part": f"long prompt, chunks of {long['chunk']}", "tokens": m["tokens"],
                "ms": round(m["seconds"] * 1e3), "peak GiB": None if m["peak_bytes"] is None else round(m["peak_bytes"] / 2**30, 2),
                "bound GiB": round(m["bound_bytes"] / 2**30, 2),
            })  # fmt: skip
        report.rows.append({
            "part": f"decode after {long['tokens']} tokens", "tokens": 1, "ms": round(long["decode_ms_median"], 2),
        })  # fmt: skip
    for r in out["pooling_ab"] or ():
        report.rows.append({
            "part": f"A/B round {r['round'] + 1}, pooling kernel {'on' if r['pooling_kernel'] else 'off'}",
            "tokens": r["tokens"], "ms": round(r["ms"], 2), "host ms": round(r["host_ms"], 2),
        })  # fmt: skip
    first = next((r for r in out["engine"] if r["tokens"] == 4096), None)
    if cuda and first is not None:
        report.target(
            "prefill at 4096 tokens: fraction of the bf16 compute roofline",
            first["fraction_of_roofline"],
            ">=",
            0.35,
        )
    if cuda and out["versus_transformers"] is not None:
        v = out["versus_transformers"]
        report.target(f"prefill at {v['tokens']} tokens: sluice / transformers", v["speedup"], ">=", 3.0)
    if cuda and long is not None:
        for m in long["marks"]:
            report.target(
                f"long prompt at {m['tokens']} tokens: peak memory / (weights + cache + 2 GiB)",
                m["peak_over_bound"],
                "<=",
                1.10,
            )
