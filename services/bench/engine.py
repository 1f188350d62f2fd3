"""Engine throughput and the chunk cost model: prefill and decode tokens/s through
``LLM.generate``, step times over a (chunk, prefix) grid fitted to
``t(C, H) = a*C*(C+H) + b*(C+H) + d*C + c`` (``costmodel.CostModel``;
``services/bench/_engine_costmodel.py``). ``--profile`` saves the fit as
``<checkpoint>/sluice_cost_model.json`` (or ``--out``), which ``LLM`` and the router load
(with ``--device cuda``, fitted to step times measured on the GPU); with ``--model`` it also measures decode step times over running sequences x
KV tokens into ``<checkpoint>/sluice_decode_steps.json``, which the Ray router's decode
balancer fits its cost model to, and, for a checkpoint with an MTP layer, speculative
verification step times into ``<checkpoint>/sluice_spec_steps.json`` (on a GPU, one file
per GPU model, ``sluice_spec_steps_h200.json``), which DSpark's scheduler on that device
prices steps with (``engine.spec.profiling``).

``--mixed DECODES`` times steps that mix decode rows with a prompt, in one pass and in two
(``services/bench/_engine_mixed.py``). ``--preset P`` runs the real-width report instead: decode tokens/s through the engine at
``P``'s widths on ``--device`` beside the memory roofline (``services/bench/_engine_decode.py``),
and prefill tokens/s beside the compute roofline, with a long prompt's time and peak memory
(``services/bench/_engine_prefill.py``), each beside transformers' ``DeepseekV4ForCausalLM``."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress
from services.bench import _engine_costmodel as grids
from services.bench._engine_costmodel import fit_and_grade


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--presets", default="tiny,small", help="gen-checkpoint presets to measure (default tiny,small)"
    )
    p.add_argument("--model", help="measure this checkpoint directory instead of generated presets")
    p.add_argument("--profile", action="store_true", help="save the fitted cost model next to the checkpoint")
    p.add_argument(
        "--out",
        help="with --profile: the JSON file (with --model; default <model>/sluice_cost_model.json) or the "
        "directory for <preset>.json files (with presets; default var/costmodel)",
    )
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prefill prompt (default 512)")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--decode-tokens", type=int, default=16, help="decode tokens per request (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="timings per grid point, minimum kept (default 5)")
    p.add_argument(
        "--profile-rounds", type=int, default=2,
        help="alternating rounds over the fit and held-out grids, each cell's minimum kept (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on shared CPUs)"
    )
    d = p.add_argument_group("decode at real widths (--preset; services/bench/_engine_decode.py)")
    d.add_argument(
        "--preset", help="the decode report on a weightless PRESET with random weights built on the device"
    )
    d.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    d.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    d.add_argument(
        "--layers", default="2", help="decoder layers, a comma list fits per-layer time (default 2)"
    )
    d.add_argument("--decode-batches", help="requests per step (default 1,16,64,256 on cuda, 1,16 on cpu)")
    d.add_argument(
        "--context", type=int, help="prompt tokens before decoding (default 4096 on cuda, 128 on cpu)"
    )
    d.add_argument("--tf-context", type=int, default=128, help="transformers' prompt tokens (default 128)")
    d.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    d.add_argument(
        "--decode-rounds", type=int,
        help="rounds of engine then transformers per batch; the ratio is their median (default 3 on cpu, 1 on cuda)",
    )  # fmt: skip
    d.add_argument("--no-transformers", action="store_true", help="skip transformers' DeepseekV4ForCausalLM")
    d.add_argument(
        "--decode-graphs", default="auto", choices=("auto", "off", "padded"),
        help="decode steps as CUDA graphs: auto (on CUDA), off, padded (their padded batches, eagerly)",
    )  # fmt: skip
    d.add_argument(
        "--async-scheduling", default="auto", choices=("auto", "on", "off"),
        help="overlap scheduling with the running step: auto (the engine's default: off), on, off",
    )  # fmt: skip
    d.add_argument(
        "--pipeline-steps", default="auto", choices=("auto", "on", "off"),
        help="launch step N+1 before sampling step N (synchronous steps): auto (on CUDA), on, off",
    )  # fmt: skip
    d.add_argument(
        "--sampling", default="greedy", choices=("greedy", "drawn", "penalised"),
        help="the decoding requests' sampling: greedy (default), drawn (temperature 0.8, top-p 0.95, "
        "seeded), penalised (drawn with repetition, presence and frequency penalties: sampled on the "
        "device once the previous step finishes)",
    )  # fmt: skip
    d.add_argument(
        "--batch-invariant", action="store_true",
        help="the batch-invariant mode (EngineConfig.batch_invariant; its own kernels on CUDA)",
    )  # fmt: skip
    d.add_argument(
        "--no-kernels", action="store_true",
        help="run the eager code instead of the Triton kernels that replace it (engine.kernels.set_kernels)",
    )  # fmt: skip
    d.add_argument(
        "--experts-gemm", default="auto", choices=("auto", "torch", "fixed", "tuned"),
        help="the routed experts' grouped GEMM at every size (CUDA, outside the batch-invariant "
        "mode; engine.model.experts.force_experts_gemm); auto: the engine's bands (default)",
    )  # fmt: skip
    d.add_argument(
        "--pooling-kernel", default="default", choices=("default", "on", "off", "ab"),
        help="the compressors' pooling kernel (engine.kernels.pooling.FUSED_POOLING; CUDA, outside "
        "the batch-invariant mode): on or off for this run, or the engine's setting (default); ab: "
        "the engine's setting, then with --parts prefill an interleaved off/on A/B (--ab-rounds)",
    )  # fmt: skip
    d.add_argument("--ab-rounds", type=int, default=3, help="rounds of --pooling-kernel ab (default 3)")
    d.add_argument(
        "--cpu-head", default="packed", choices=("packed", "torch"),
        help="the output head on the CPU: oneDNN with its weight packed once (engine.model.packed_linear, "
        "the engine's default) or torch's F.linear, for an A/B",
    )  # fmt: skip
    d.add_argument(
        "--quant", default="none", choices=("none", "fp8", "fp8-w8a8"),
        help="fp8: the random weights quantised to FP8 (128x128 block scales) and kept so, as an FP8 "
        "checkpoint with keep_quantized (read by engine.kernels.fp8 on CUDA, bf16 activations); "
        "fp8-w8a8: the same weights with the activations quantised too (fp8_compute='w8a8', FP8 "
        "tensor cores); none: bf16/fp32",
    )  # fmt: skip
    d.add_argument(
        "--parts", default="decode,prefill",
        help="which parts of the --preset report to run: decode, prefill (default both)",
    )  # fmt: skip
    m = p.add_argument_group("mixed steps (services/bench/_engine_mixed.py)")
    m.add_argument(
        "--mixed", metavar="DECODES",
        help="time a step of DECODES (a comma list) decode rows beside one --prompt-tokens prompt, in one "
        "pass and in two (ModelRunner.split), on --model (default models/trained), --context tokens in "
        "(default 256), --repeats rounds, on --device",
    )  # fmt: skip
    f = p.add_argument_group("prefill at real widths (--preset; services/bench/_engine_prefill.py)")
    f.add_argument(
        "--prefill-tokens", help="one-chunk prefill sizes (default 4096,16384 on cuda, 256 on cpu)"
    )
    f.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per size (default 3)")
    f.add_argument(
        "--long-context", type=int,
        help="a prompt this long prefilled in chunks, then decoded (default 131072 on cuda, 0 (off) on cpu)",
    )  # fmt: skip
    f.add_argument("--long-chunk", type=int, default=4096, help="the long prompt's chunk (default 4096)")
    f.add_argument(
        "--host-profile", action="store_true",
        help="one more step per size under cProfile: where the host's time goes (results: host_profile)",
    )  # fmt: skip


def _throughput(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, num_blocks=64, num_swa_slots=2 * args.batch, max_num_seqs=args.batch)
    try:
        vocab = llm.vocab_size
        prompts = [[(17 * i + 31 * j) % vocab for j in range(args.prompt_tokens)] for i in range(args.batch)]
        many = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=[prompts[0][:32]], sampling_params=many)  # warm-up
        llm.loop.stats.clear()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=many)
        wall = time.perf_counter() - t0
        stats = list(llm.loop.stats)
    finally:
        llm.close()
    # Pure steps only: prefill throughput from steps with no decodes, decode from decode-only steps.
    pre = [s for s in stats if s.decode_tokens == 0]
    dec = [s for s in stats if s.prefill_tokens == 0]
    return {
        "prefill_tok_per_s": sum(s.prefill_tokens for s in pre) / max(sum(s.seconds for s in pre), 1e-9),
        "decode_tok_per_s": sum(s.decode_tokens for s in dec) / max(sum(s.seconds for s in dec), 1e-9),
        "decode_steps": len(dec),
        "end_to_end_tok_per_s": args.batch * (args.prompt_tokens + 1 + args.decode_tokens) / wall,
    }


def _measure(name: str, model_dir: Path, args: argparse.Namespace, report: Report, out: Path) -> None:
    progress(f"{name}: throughput")
    tput = _throughput(model_dir, args)
    progress(
        f"{name}: step-time grid {len(grids.GRID_C)}x{len(grids.GRID_H)}, then {len(grids.HELDOUT_C)}x{len(grids.HELDOUT_H)} held out"
    )
    model, fit = fit_and_grade(
        model_dir, "cpu", (grids.GRID_C, grids.GRID_H), (grids.HELDOUT_C, grids.HELDOUT_H),
        args.repeats, args.profile_rounds,
    )  # fmt: skip
    if args.profile:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(model.to_json())
        fit["saved_to"] = str(out)
        if args.model:  # the decode step times too, for the router's decode balancer
            fit["decode_steps_saved_to"] = str(_profile_decode(model_dir, args))
            spec = _profile_spec(model_dir, args)
            if spec is not None:
                fit["spec_steps_saved_to"] = str(spec)
    report.results[name] = {**tput, **fit}
    skip = ("saved_to", "samples_chunk_prefix_s", "abs_fit_rel_rmse", "heldout_samples_chunk_prefix_s")
    report.rows.append({"model": name, **tput, **{k: v for k, v in fit.items() if k not in skip}})
    report.target(f"{name}: costmodel fit_rel_rmse", fit["fit_rel_rmse"], "<=", 0.25)
    report.target(f"{name}: costmodel held-out rel RMSE", fit["heldout_rel_rmse"], "<=", 0.25)


def _profile_decode(model_dir: Path, args: argparse.Namespace) -> Path:
    """Decode step times of ``model_dir``'s architecture on this machine, over running
    sequences x KV tokens, saved beside it (``DECODE_STEPS_FILE``): the router fits its
    decode cost model to them (``services.ray.serving``)."""
    from engine.engine_config import DECODE_STEPS_FILE
    from services.bench._router_profile import profile_decode

    progress(f"{model_dir.name}: decode step times (batch x KV tokens)")
    table = profile_decode(
        model_dir=model_dir, repeats=args.repeats, threads=args.threads, device=args.device
    )
    out = model_dir / DECODE_STEPS_FILE
    out.write_text(json.dumps(table, indent=1) + "\n")
    return out


def _profile_decode_on_gpu(model_dir: Path, args: argparse.Namespace, report: Report) -> None:
    """``--profile --device cuda --model DIR``: the decode step table measured on this GPU
    (bf16, CUDA graphs), saved beside the checkpoint, where the decode balancer of
    ``sluice serve --config`` fits its cost model from it; then the prefill chunk cost model
    fitted to step times over the GPU grid (`profile_prefill`), saved as
    ``sluice_cost_model.json`` (or ``--out``), which the engine's scheduler and the router
    load. Both fits and their errors are reported."""
    from router.steptable import StepTable

    progress(f"{model_dir.name}: prefill step times (chunk x prefix) on {args.device}")
    progress(
        f"{model_dir.name}: then held-out shapes (chunks {grids.GPU_HELDOUT_C} x prefixes {grids.GPU_HELDOUT_H})"
    )
    model, pre = fit_and_grade(
        model_dir, args.device, (grids.GPU_GRID_C, grids.GPU_GRID_H),
        (grids.GPU_HELDOUT_C, grids.GPU_HELDOUT_H), args.repeats, args.profile_rounds,
    )  # fmt: skip
    cost_out = Path(args.out or model_dir / "sluice_cost_model.json")
    cost_out.parent.mkdir(parents=True, exist_ok=True)
    cost_out.write_text(model.to_json() + "\n")
    report.results["prefill_profile"] = {**pre, "saved_to": str(cost_out)}
    report.rows.append({
        "model": model_dir.name, "prefill a": pre["a"], "b": pre["b"], "c": pre["c"],
        "fit rel RMSE": round(pre["fit_rel_rmse"], 3), "max rel err": round(pre["fit_max_rel_err"], 3),
        "held-out rel RMSE": round(pre["heldout_rel_rmse"], 3),
    })  # fmt: skip
    report.target("prefill cost model fit_rel_rmse (GPU)", pre["fit_rel_rmse"], "<=", 0.25)
    report.target("prefill cost model held-out rel RMSE (GPU)", pre["heldout_rel_rmse"], "<=", 0.25)
    out = _profile_decode(model_dir, args)
    table = StepTable.load(out)
    context = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    model = table.fit(max_tokens_per_sequence=context)
    cells = table.samples(context)
    rel = [(model.step_time(b, k) - t) / t for b, k, t in cells]
    rmse = math.sqrt(statistics.fmean(r * r for r in rel))
    report.results["decode_profile"] = {
        "saved_to": str(out), "d0_s": model.d0, "d1_s_per_sequence": model.d1, "d2_s_per_kv_token": model.d2,
        "cells_fitted": len(cells), "fit_rel_rmse": rmse, "fit_max_rel_err": max(abs(r) for r in rel),
    }  # fmt: skip
    report.rows.append({
        "model": model_dir.name, "decode d0 ms": round(model.d0 * 1e3, 3), "d1 us/seq": round(model.d1 * 1e6, 2),
        "d2 ns/KV token": round(model.d2 * 1e9, 3), "fit rel RMSE": round(rmse, 3),
    })  # fmt: skip
    report.target("decode cost model fit_rel_rmse (GPU)", rmse, "<=", 0.25)
    spec = _profile_spec(model_dir, args)
    if spec is not None:
        report.results["decode_profile"]["spec_steps_saved_to"] = str(spec)


def _profile_spec(model_dir: Path, args: argparse.Namespace, **settings: Any) -> Path | None:
    """Speculative verification step times (batch x drafts verified) of a checkpoint with an
    MTP layer, measured on ``--device`` and saved beside it under that device's name
    (`device_steps_file`: the CPU's file, or one per GPU model), where DSpark's scheduler on
    that device loads it. ``settings``: `measure_spec_profile`'s (its defaults: batches 1 to
    128, 5 drafts)."""
    from engine.spec.profiling import device_steps_file, measure_spec_profile

    if not json.loads((model_dir / "config.json").read_text()).get("num_nextn_predict_layers"):
        return None
    progress(
        f"{model_dir.name}: speculative verification step times (batch x drafts verified) on {args.device}"
    )
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    profile = measure_spec_profile(model_dir, progress=progress, device=args.device, dtype=dtype, **settings)
    out = model_dir / device_steps_file(args.device)
    out.write_text(profile.to_json() + "\n")
    return out


def run(args: argparse.Namespace) -> Report:
    import torch

    torch.set_num_threads(args.threads)
    gpu = "GPU_" if args.device.startswith("cuda") else ""  # the prefill grids of this device
    report = Report(
        "engine",
        config={
            k: getattr(args, k)
            for k in (
                "presets",
                "model",
                "profile",
                "prompt_tokens",
                "batch",
                "decode_tokens",
                "repeats",
                "profile_rounds",
            )
        }
        | {
            key: getattr(grids, gpu + name)
            for key, name in (
                ("grid_chunk", "GRID_C"),
                ("grid_prefix", "GRID_H"),
                ("heldout_chunk", "HELDOUT_C"),
                ("heldout_prefix", "HELDOUT_H"),
            )
        }  # fmt: skip
        | {"torch_threads": torch.get_num_threads()},
    )
    if args.mixed:
        from services.bench._engine_mixed import mixed_report

        mixed_report(args, report)
        return report
    if args.preset:
        from services.bench._engine_report import preset_report

        preset_report(args, report)
        return report
    if args.model and args.profile and args.device.startswith("cuda"):
        _profile_decode_on_gpu(Path(args.model), args, report)
        return report
    if args.model:
        model_dir = Path(args.model)
        _measure(
            model_dir.name, model_dir, args, report, Path(args.out or model_dir / "sluice_cost_model.json")
        )
        return report
    out_dir = Path(args.out or "var/costmodel")
    from engine.checkpoint.generate import generate_checkpoint

    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        with tempfile.TemporaryDirectory(prefix=f"sluice-bench-{preset}-") as tmp:
            progress(f"{preset}: generating the checkpoint")
            generate_checkpoint(preset, Path(tmp))
            _measure(preset, Path(tmp), args, report, out_dir / f"{preset}.json")
    return report


def main() -> None:
    """``python -m services.bench.engine`` (same as ``sluice bench engine``)."""
    module_main("engine", add_arguments, run, None)


if __name__ == "__main__":
    main()
