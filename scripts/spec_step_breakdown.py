"""Where a speculating step's time goes: the device's kernels and the host's Python.

One engine per cell, at a generated preset's widths with random weights built on the device
(as `sluice bench spec --width-profile` measures them; ``--ep N``: one EP N rank's share of
the routed experts, `engine.spec.profiling.rank_experts`), or a checkpoint with its own
weights and held-out prompts (``--model``: real drafts and acceptance), ``--batch`` requests
decoding: plain decoding, ``fixed-0:5`` (five drafts drafted, none verified) and ``fixed-5:5``
(all five verified), or the settings ``--cells`` names. For each cell, after warm-up steps:

* the median wall time of a step (synchronised), warmed until no step captures a new graph,
  and over the timed steps that captured none (a graph's capture and first replays are not
  what a warm step costs); the count of those that did;
* on CUDA, the time the device spends in kernels per step (CUDA profiler) and the kernels
  that take most of it: what the wall time has beyond it is host time the device waited for;
* the host's functions by their own time, and the engine's by cumulative time (cProfile,
  ``--top`` each), where waiting on the device shows as ``tolist`` and ``Event.synchronize``.

    python3 scripts/spec_step_breakdown.py --preset flash-shape --ep 32 --layers 4 --batch 128 \\
        --device cuda --out breakdown.txt
    python3 scripts/spec_step_breakdown.py --model models/trained --batch 60 \\
        --cells none,fixed-5,dspark --device cuda --out breakdown.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

CELLS = (None, "fixed-0:5", "fixed-5:5")
WARMUP_STEPS = 40  # the most steps before the timed ones: the prompts' step, then warm-up
WARM_STREAK = 4  # warm once this many steps in a row captured no graph
MIN_WARMUP = 8  # and at least this many steps ran


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash-shape")
    ap.add_argument(
        "--model", default=None,
        help="a checkpoint directory (its own weights, held-out prompts: real drafts and acceptance) "
        "instead of --preset's widths with random weights",
    )  # fmt: skip
    ap.add_argument(
        "--cells", default=",".join(c or "none" for c in CELLS),
        help="the speculative settings timed, comma-separated (none: plain decoding)",
    )  # fmt: skip
    ap.add_argument("--ep", type=int, default=1, help="time one rank of EP N (its share of the experts)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10, help="steps timed, and profiled, per cell")
    ap.add_argument("--top", type=int, default=25, help="kernels and host functions listed per cell")
    ap.add_argument("--out", required=True, help="the report (text)")
    args = ap.parse_args()

    import torch

    from engine.core import EngineCore
    from engine.engine_config import EngineConfig
    from engine.messages import CoreRequest
    from engine.sampling.params import SamplingParams
    from engine.spec.profiling import _prompts, graph_captures, rank_experts, rank_model_dir, release_memory

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.model is None:
        model = rank_model_dir(args.preset, args.ep, args.layers, Path(tempfile.mkdtemp()) / "model")
        what = (
            f"{args.preset}, {args.layers} layers, EP {args.ep} rank "
            f"({'every expert' if args.ep == 1 else f'{rank_experts(args.preset, args.ep)} routed experts'})"
        )
    else:
        model, what = Path(args.model), f"{args.model} (its weights)"
    b = args.batch
    prompts, source = _prompts(model, b, 256, 0)
    report = [
        f"{what}, {b} requests ({source}), {args.device}, {torch.cuda.get_device_name() if cuda else 'cpu'}"
    ]
    cells = [None if c == "none" else c for c in args.cells.split(",") if c]
    for spec in cells:
        cfg = EngineConfig(
            model=str(model), speculative=spec, max_num_seqs=b, num_swa_slots=b, num_blocks=4 * b + 4,
            max_num_batched_tokens=max(32_768, 256 * b), enable_prefix_caching=False, async_scheduling=False,
            random_weights=0 if args.model is None else None, device=args.device,
            dtype="bfloat16" if cuda else "float32",
        )  # fmt: skip
        core = EngineCore(cfg)
        try:
            # every step may emit a token and five drafts a request: none ends before the last step
            most_steps = WARMUP_STEPS + 3 * args.steps
            params = SamplingParams(temperature=0.0, max_tokens=6 * most_steps, ignore_eos=True)
            for i in range(b):
                core.add(CoreRequest(f"r{i}", tuple(prompts[i]), params))

            # the prompts, then warm-up until WARM_STREAK steps in a row capture no new graph: a
            # graph's first replays (and its capture) are not what a step costs once it is warm
            quiet = 0
            for i in range(WARMUP_STEPS):
                before = graph_captures(core)
                core.step()
                quiet = quiet + 1 if graph_captures(core) == before else 0
                if quiet >= WARM_STREAK and i + 1 >= MIN_WARMUP:
                    break
            sync()
            walls, captured = [], 0
            for _ in range(args.steps):
                before = graph_captures(core)
                t0 = time.perf_counter()
                core.step()
                sync()
                if graph_captures(core) == before:
                    walls.append(time.perf_counter() - t0)
                else:
                    captured += 1
            median = f"{1e3 * statistics.median(walls):.2f} ms a step" if walls else "every step captured"
            report.append(
                f"\n== {spec or 'plain decoding'}: {median} ({len(walls)} steps timed, {captured} left out "
                f"for capturing a graph; {graph_captures(core)} graphs captured in all)"
            )
            profiled = graph_captures(core)
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        core.step()
                    sync()
                kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
                busy = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
                launches = sum(e.count for e in kernels) / args.steps
                report.append(
                    f"device busy {busy:.2f} ms a step in {launches:.0f} kernels; kernels by device time a step:"
                )
                for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.top]:
                    per_step = e.self_device_time_total / 1e3 / args.steps
                    report.append(f"  {per_step:7.3f} ms  x{e.count / args.steps:5.0f}  {e.key[:100]}")
            host = cProfile.Profile()
            host.enable()
            for _ in range(args.steps):
                core.step()
            sync()
            host.disable()
            if graph_captures(core) != profiled:
                report.append(
                    f"(the profiled steps captured {graph_captures(core) - profiled} graphs: read them with care)"
                )
            text = io.StringIO()
            stats = pstats.Stats(host, stream=text)
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats("engine/", args.top)
            report.append(
                f"host functions by own time, then the engine's by cumulative time, {args.steps} steps:\n{text.getvalue()}"
            )
        finally:
            core.close()
            del core
            release_memory({"device": args.device})
        print(report[-1][:300], flush=True)
    Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
