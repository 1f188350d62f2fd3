"""End to end: colocated vs disaggregated serving on a replayed conversation trace.

Real processes on this machine: a loopback Ray instance (``prefill`` and ``decode``
resources), a KV store of 12 node processes with its Redis directory
(``services.local.store.LocalStore``), and two engine actors per configuration, driven
through ``services.ray.serving.RayServingClient``:

- ``colocated``: two engines in the prefill pool, no decode pool: each engine runs its
  requests whole;
- ``disaggregated``: one prefill engine and one decode engine: the prefill engine returns
  the first token and hands the sequence (blocks, window slot) to the decode engine.

The two configurations run one after the other, each on the same workload:

1. a replay of the first ``--requests`` requests of a Mooncake trace (``timestamp`` in ms,
   ``input_length``, ``output_length``, ``hash_ids``: prefix blocks of 512 tokens), token
   counts scaled by ``--scale`` and time by ``--time-scale``, sent concurrently at their
   scaled arrival times. Prompts are built from the hash ids: each id is a fixed seeded run
   of token ids in [10, 1000), so prefixes the trace shares are shared token prefixes; the
   seed also names the configuration, so the second configuration finds nothing the first
   left in the KV store. Greedy, ``ignore_eos``: every request produces exactly its
   (scaled) output length;
2. a low-load probe: one request of ``--probe-tokens`` new tokens at a time, three times.

Per request: TTFT (submit to the first output with tokens), t2 (first token to second
token: in the disaggregated configuration the handoff is in this gap), TPOT ((last - first)
/ (n - 1)); per configuration, output tokens / makespan. For the disaggregated replay the
handoff bytes the decode engine received (its ``handoff_bytes_in`` / ``handoffs_in``) are set
against the cache formula (``CacheSpec.paged_bytes_per_token`` summed over the layers, times
the prompt tokens, plus one sequence's window slot). Target: the probe's t2 median,
disaggregated / colocated, within 1.1. The run: ``services/bench/_e2e_real.py``.

Two more sections (``--parts``, default ``real,sim``; ``--sim-only`` and ``--handoff-only``
run one alone):

- ``simulator``: the same policies in ``router.pd_sim`` at DeepSeek's scale, 64 prefill + 64
  decode engines against 128 colocated engines (best chunk budget of a sweep), step times
  from a cost model fitted to GPU measurements and scaled to the model's full depth,
  goodput under TTFT and TPOT SLOs (``services/bench/_e2e_sim.py``). Target: disaggregated
  goodput >= 1.5x colocated, per trace;
- ``handoff_131k``: one long prompt (``--handoff-tokens``, default 131,072) prefilled on a
  real ``EngineCore`` and exported: payload bytes against the cache formula, export and
  import times, and whether the transfer overlaps compute layer by layer
  (``services/bench/_e2e_handoff.py``).
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path
from typing import Any

from services.bench import Report, _e2e_sim
from services.bench._e2e_real import run_real
from services.bench._e2e_trace import build_prompt, scale_trace  # noqa: F401  (re-exported for its tests)

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_trace.jsonl"
PARTS = ("real", "sim", "handoff")
DEFAULT_PARTS = ("real", "sim")  # the long handoff is asked for: its CPU prefill takes many minutes


def _fraction(text: str) -> float:
    value = float(Fraction(text))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"needs a positive number or fraction, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="tiny", help="checkpoint preset (default tiny, generated on first use)"
    )
    p.add_argument("--model", help="use this checkpoint directory instead of the preset")
    p.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--requests", type=int, default=16, help="replay the first N requests of the trace")
    p.add_argument(
        "--scale", type=_fraction, default=1 / 16,
        help="token scale (default 1/16: a 512-token hash block becomes 32 tokens; outputs scaled "
        "the same way, at least 2 tokens)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=_fraction, default=4.0,
        help="multiplies the trace's arrival times (default 4: the first 16 requests arrive over 12 s)",
    )  # fmt: skip
    p.add_argument(
        "--probe-tokens", type=int, default=4096,
        help="prompt tokens of the low-load probe (trimmed to the context and the engine's blocks)",
    )  # fmt: skip
    p.add_argument("--num-blocks", type=int, default=64, help="engine KV blocks (256 tokens each)")
    p.add_argument("--chunk", type=int, default=512, help="engine max_num_batched_tokens")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the token runs")
    p.add_argument(
        "--transports", default="object_store,grpc",
        help="handoff transports of the disaggregated configurations (default object_store,grpc)",
    )  # fmt: skip
    p.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS),
        help=f"sections to run, comma-separated from {', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})",
    )  # fmt: skip
    p.add_argument("--sim-only", action="store_true", help="run only the simulator section (--parts sim)")
    p.add_argument("--handoff-only", action="store_true", help="run only the long handoff (--parts handoff)")
    p.add_argument(
        "--handoff-tokens", type=int, default=131_072,
        help="prompt tokens of the long handoff (default 131,072; a 2-core CPU takes ~5 min per 32,768)",
    )  # fmt: skip
    p.add_argument("--handoff-chunk", type=int, default=8192, help="prefill chunk of the long handoff")
    p.add_argument("--handoff-device", default="cpu", help="device of the long handoff's engines (cpu, cuda)")
    _e2e_sim.add_arguments(p)


def parts_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The sections to run, in report order."""
    if args.sim_only and args.handoff_only:
        raise ValueError("--sim-only and --handoff-only exclude each other")
    if args.sim_only:
        return ("sim",)
    if args.handoff_only:
        return ("handoff",)
    parts = tuple(x.strip() for x in str(args.parts).split(",") if x.strip())
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise ValueError(f"--parts takes some of {', '.join(PARTS)}, got {args.parts!r}")
    return tuple(x for x in PARTS if x in parts)


def run(args: argparse.Namespace) -> Report:
    parts = parts_of(args)
    report = Report("e2e", config={"parts": list(parts)})
    if "real" in parts:
        run_real(args, report)
    if "sim" in parts:
        add_simulator(report, _e2e_sim.run_simulator(args))
    if "handoff" in parts:
        add_handoff(report, _run_handoff(args))
    return report


def add_simulator(report: Report, sim: dict[str, Any]) -> None:
    """The ``simulator`` section, its rows and its targets (one per trace)."""
    report.results["simulator"] = sim
    for name, tr in sim["traces"].items():
        head = tr["headline"]
        report.rows.append({
            "config": f"sim {name}", "done": f"{tr['requests']} req",
            "slo_level": head["level"] if head["level"] is not None else "",
            "goodput_dis_req_s": head["disaggregated_goodput_req_s"],
            "goodput_colo_req_s": head["colocated_goodput_req_s"],
            "colo_router": head["colocated_best_prefill_policy"], "colo_budget": head["colocated_best_budget"],
            "goodput_ratio": head["goodput_ratio"],
        })  # fmt: skip
        report.target(
            f"simulator goodput, disaggregated / colocated ({name})",
            head["goodput_ratio"],
            ">=",
            _e2e_sim.TARGET,
        )


def _run_handoff(args: argparse.Namespace) -> dict[str, Any]:
    from services import envs
    from services.bench._e2e_handoff import long_context_model, run_handoff

    if args.handoff_tokens < 1 or args.handoff_chunk < 1:
        raise ValueError("--handoff-tokens and --handoff-chunk need at least 1")
    model = long_context_model(envs.HOME.get(), args.handoff_tokens)
    return run_handoff(model, args.handoff_tokens, args.handoff_chunk, args.seed, args.handoff_device)


def add_handoff(report: Report, h: dict[str, Any]) -> None:
    report.results["handoff_131k"] = h
    report.rows.append({
        "config": f"handoff {h['prompt_tokens']} tokens", "done": f"{h['decoded_after_import']} decoded after import",
        "handoff_B/req": h["payload_bytes"], "formula_B/req": h["bytes"]["formula_bytes_per_request"],
        "bytes/formula": h["bytes"]["measured_over_formula"], "export_ms": h["export_ms"],
        "import_ms": h["import_ms"], "overlaps_layers": h["overlaps_compute_layer_by_layer"],
    })  # fmt: skip
