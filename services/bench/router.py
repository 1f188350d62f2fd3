"""Router policies on Mooncake traces (simulated engines) and decision latency (--micro).

Trace mode: every policy (and the SGLang router binary as a peer, unless --no-sglang) is
replayed against the same simulated prefill/decode pools; see docs/router.md for the
metric definitions. Every trace (the shared ones and the generated ones: "long documents"
and "agents", the same agents in a burst, and four differently shaped families) also gets a
decode-balance run graded with decode step times measured on
the engine (``router/data/decode_step_table.json``). --micro: p99 latency of one
in-process routing decision with 100,000 indexed blocks. --profile-decode: measure that
step-time table on the engine (CPU) and write it (``services/bench/_router_profile.py``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from services.bench import Report, module_main, progress
from services.bench._router_profile import (  # noqa: F401  (_fill_caches, profile_decode: re-exported for tests)
    PROFILE_KV,
    _fill_caches,
    profile_decode,
    run_profile_decode,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = (
    REPO / "data/traces/conversation_trace.jsonl",
    REPO / "data/traces/synthetic_trace.jsonl",
)
BASELINES = ("round_robin", "least_load", "cache_aware")
DEFAULT_STEP_TABLE = REPO / "router/data/decode_step_table.json"
# The router's decode model is fitted to the cells whose sequences are at most this deep on
# average: 256K tokens, the longest request of the four workloads (the top of the long
# documents' range). Deeper cells (one sequence of 1-8M tokens) are states no run reaches.
FIT_MAX_TOKENS_PER_SEQUENCE = 262_144


def _holdout_shapes() -> dict[str, Any]:
    from router.gen_traces import AgentParams, LongDocsParams

    return {
        # twice the long requests, short ones 4x shorter, answers 2x longer
        "long_documents_wide": LongDocsParams(long_fraction=0.2, short_median=1024, output_median=512),
        # half the long requests, and those 4x shorter (32K-128K); short answers
        "long_documents_narrow": LongDocsParams(
            long_fraction=0.05, long_min=32_768, long_max=131_072, output_median=128
        ),
        # half the turns on a 2x larger first prompt, 80 % reuse, 2x longer answers
        "agents_short_sessions": AgentParams(
            sessions=600, turns=10, reuse=0.8, first_median=8192, output_median=512
        ),
        # twice the turns, 97 % reuse, a 2x smaller first prompt, turns 2.5x closer together
        "agents_long_sessions": AgentParams(
            sessions=200, turns=40, reuse=0.97, first_median=2048, think_mean_s=2.0
        ),
    }


HOLDOUT_SHAPES = _holdout_shapes()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", action="append", type=Path, help="Mooncake JSONL trace (repeatable); "
                   "default: both traces in the repo's data/traces/")  # fmt: skip
    p.add_argument("--prefill", type=int, default=8, help="simulated prefill engines")
    p.add_argument("--decode", type=int, default=8, help="simulated decode engines")
    p.add_argument("--cache-blocks", type=int, default=32_768, help="LRU blocks per prefill engine")
    p.add_argument(
        "--store-blocks", type=int, default=0, help="global KV store blocks behind all engines (0: none)"
    )
    p.add_argument("--load", type=float, default=0.7, help="online run: reference work / pool capacity")
    p.add_argument("--offline-load", type=float, default=1.5, help="offline (throughput) run load")
    p.add_argument("--limit", type=int, default=None, help="use only the first N rows of each trace")
    p.add_argument("--micro", action="store_true", help="decision-latency micro benchmark only")
    p.add_argument("--no-sglang", action="store_true", help="skip the sglang-router peer")
    p.add_argument("--peer-requests", type=int, default=1500,
                   help="rows replayed through the sglang-router binary (and compared on that subset)")  # fmt: skip
    p.add_argument("--peer-seconds", type=float, default=45.0, help="wall-clock budget per peer replay")
    p.add_argument("--step-table", type=Path, default=DEFAULT_STEP_TABLE,
                   help="decode step-time table measured on the engine (grades the decode runs)")  # fmt: skip
    p.add_argument("--no-generated", action="store_true",
                   help="skip the generated traces (long documents, agents, agents_burst, the held-out shapes)")  # fmt: skip
    p.add_argument("--decode-only", action="store_true",
                   help="only the decode-balance runs (no prefill replay, no sglang peer)")  # fmt: skip
    p.add_argument(
        "--decode-ablation", action="store_true", help="also run sluice's decode balancer under each rule"
    )
    p.add_argument("--decode-utilization", type=float, default=0.75,
                   help="decode-balance runs: offered decode tokens / the pool's peak decode throughput")  # fmt: skip
    p.add_argument(
        "--seeds", type=int, default=5, help="generated traces: one per seed 0..N-1, figures averaged"
    )
    p.add_argument("--profile-decode", action="store_true",
                   help="measure the decode step-time table on the engine (CPU) and write --step-table")  # fmt: skip
    p.add_argument(
        "--preset", default="tiny", help="--profile-decode: gen-checkpoint preset (random weights)"
    )
    p.add_argument("--device", default="cpu", help="--profile-decode: cpu, or cuda (bf16, CUDA graphs)")
    p.add_argument("--layers", type=int, help="--profile-decode: resize the preset to this many layers")
    p.add_argument(
        "--kv-tokens",
        help=f"--profile-decode: the KV grid, a comma list (default {','.join(map(str, PROFILE_KV))})",
    )
    p.add_argument(
        "--online-fit", action="store_true",
        help="grade the decode cost model refitted while serving (costmodel.online) on two served "
        "workloads, against the profiled table's fit (services/bench/_decode_online.py)",
    )  # fmt: skip
    p.add_argument("--model", type=Path, default=REPO / "models/trained", help="--online-fit: the checkpoint")
    p.add_argument(
        "--speculative", default=None, metavar="POLICY",
        help="--online-fit: the served engines speculate (EngineConfig.speculative, e.g. fixed-3): their "
        "steps verify drafts, which the plain-decode table does not time (default: off)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="--profile-decode: passes over the grid")
    p.add_argument("--repeats", type=int, default=5, help="--profile-decode: timed steps per cell and pass")
    p.add_argument(
        "--zeroed-caches", action="store_true",
        help="--profile-decode: time steps over zeroed cache blocks (the tables before 2026-12-05), "
        "for an A/B against the default seeded random entries",
    )  # fmt: skip


def run(args: argparse.Namespace) -> Report:
    if args.micro:
        return _run_micro()
    if args.profile_decode:
        return run_profile_decode(args)
    if args.online_fit:
        from services.bench._decode_online import run_online_fit

        return run_online_fit(args.model, args.rounds, args.repeats, seed=0, speculative=args.speculative)
    return _run_traces(args)


def _run_micro() -> Report:
    from router.micro import micro

    report = Report("router", config={"mode": "micro", "indexed_blocks": 100_000, "engines": 8})
    # the live router's settings (router.gctune) first, then CPython's default collector
    for key, tuned in (("sluice_select", True), ("sluice_select_default_gc", False)):
        res = micro(tuned_gc=tuned)
        progress(f"micro ({'tuned' if tuned else 'default'} GC): {res}")
        report.results[key] = res.__dict__
        report.rows.append(res.__dict__)
    tuned_p99 = report.results["sluice_select"]["p99_us"]
    report.target("sluice select p99 latency (us), 100k indexed blocks", tuned_p99, "<=", 100.0)
    return report


def _traces(args: argparse.Namespace) -> list[Path]:
    paths = args.trace or list(DEFAULT_TRACES)
    for p in paths:
        if not p.is_file():
            raise ValueError(
                f"trace {p} not found. Pass --trace PATH to a Mooncake JSONL trace "
                f"(the repo ships two in data/traces/; see its SOURCE.md)"
            )
    return paths


def _run_traces(args: argparse.Namespace) -> Report:
    from router.evaluate import POLICY_NAMES, evaluate
    from router.sim import SimConfig
    from router.trace import load_trace

    cfg = SimConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        cache_blocks=args.cache_blocks,
        store_blocks=args.store_blocks,
    )
    config: dict[str, Any] = {
        "mode": "trace", "prefill_engines": cfg.num_prefill, "decode_engines": cfg.num_decode,
        "cache_blocks_per_engine": cfg.cache_blocks, "store_blocks": cfg.store_blocks, "load": args.load, "offline_load": args.offline_load,
        "limit": args.limit, "cost_model": cfg.cost.to_json(), "decode_cost_model": cfg.decode_cost.to_json(),
        "traces": [], "sglang_peer": not args.no_sglang and not args.decode_only, "peer_requests": args.peer_requests,
    }  # fmt: skip
    report = Report("router", config=config)
    traces = [load_trace(path, limit=args.limit) for path in _traces(args)]
    config["traces"] = [str(p) for p in _traces(args)]
    generated = [] if args.no_generated else _generated(args.seeds, config)
    dcfg = _decode_config(args, cfg, traces + [t for family in generated for t in family], config)
    for trace in traces:
        entry: dict[str, Any] = {}
        if not args.decode_only:
            ref, res = evaluate(trace, cfg, POLICY_NAMES, args.load, args.offline_load, progress=progress)
            entry = {"reference": ref.__dict__ | {"rows": len(trace)}, "policies": res}
            for name, r in res.items():
                report.rows.append({"trace": trace.name, "policy": name, **_row(r)})
            _targets(report, trace.name, res)
        report.results[trace.name] = entry
        report.results[trace.name]["decode_balance"] = _decode_balance(report, [trace], dcfg, args)
        if not args.no_sglang and not args.decode_only:
            _run_peer(args, report, trace.head(min(args.peer_requests, len(trace))), cfg)
    for family in generated:
        report.results[family[0].name] = {"decode_balance": _decode_balance(report, family, dcfg, args)}
    return report


def _generated(seeds: int, config: dict[str, Any]) -> list[list[Any]]:
    """The generated traces (router.gen_traces), one per seed 0..seeds-1; their parameters
    and measured shape printed in the config. ``agents_burst``: the agents trace with every
    session started within ~200 s, so that load peaks past the engines' best batch and
    requests queue at the decode engines (overload). The last four (``HOLDOUT_SHAPES``) are
    shaped differently from the issue's two and from every trace the decode balancer's rule
    was chosen on: a check that its quality holds on workloads it was never compared on."""
    import dataclasses

    from router.gen_traces import AgentParams, LongDocsParams, agents, describe, long_documents

    def named(gen: Any, name: str) -> Any:
        return lambda seed, params: dataclasses.replace(gen(seed, params), name=name)

    out: list[list[Any]] = []
    config["generated_traces"] = {"seeds": list(range(seeds))}
    gens: list[tuple[Any, Any]] = [
        (long_documents, LongDocsParams()),
        (agents, AgentParams()),
        (named(agents, "agents_burst"), AgentParams(session_rate_per_s=4 * AgentParams().session_rate_per_s)),
        *((named(long_documents if isinstance(p, LongDocsParams) else agents, name), p)
          for name, p in HOLDOUT_SHAPES.items()),
    ]  # fmt: skip
    for gen, params in gens:
        family = [gen(seed, params) for seed in range(seeds)]
        shape = [describe(t, params) for t in family]
        config["generated_traces"][family[0].name] = {"params": shape[0]["params"]} | {
            "per_seed": [{k: v for k, v in d.items() if k != "params"} for d in shape]
        }
        progress(f"generated trace {family[0].name}: {config['generated_traces'][family[0].name]}")
        out.append(family)
    return out


def _decode_config(args: argparse.Namespace, cfg: Any, traces: list[Any], config: dict[str, Any]) -> Any:
    """Decode engines step at the measured table; routers score with the model fitted to
    it over the cells a decode engine can reach: sequences no deeper, on average, than
    ``FIT_MAX_TOKENS_PER_SEQUENCE``."""
    import dataclasses

    from router.steptable import StepTable

    table = StepTable.load(args.step_table)
    longest = max(int((t.input_len + t.output_len).max()) for t in traces)
    fitted = table.fit(max_tokens_per_sequence=FIT_MAX_TOKENS_PER_SEQUENCE)
    meta_keys = ("preset", "device", "cpu", "torch", "torch_threads", "date", "statistic",
                 "load_average_before", "load_average_after", "command")  # fmt: skip
    config["decode_balance"] = {
        "step_table": str(args.step_table),
        "step_table_meta": {k: table.meta.get(k) for k in meta_keys},
        "fit_max_tokens_per_sequence": FIT_MAX_TOKENS_PER_SEQUENCE,
        "longest_context_in_traces": longest,
        "fitted_decode_cost_model": fitted.to_json(),
        "fit_cells": len(table.samples(FIT_MAX_TOKENS_PER_SEQUENCE)),
    }
    progress(f"decode step table {args.step_table}: fitted router model {fitted}")
    return dataclasses.replace(cfg, decode_cost=fitted, decode_step=table)


DECODE_KEYS = ("tpot_p50_ms", "tpot_p99_ms", "running_per_engine_mean", "running_max_over_mean", "kv_max_over_mean", "step_max_over_mean",
               "step_instant_max_over_mean", "decode_wait_p99_s")  # fmt: skip


def _decode_balance(report: Report, family: list[Any], dcfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Decode-balance runs of one trace (or of one generated trace per seed: then every
    figure is the mean over the seeds, and each seed's figures are kept too)."""
    import statistics

    from router.evaluate import POLICY_NAMES, decode_stress

    extra = _ablation_builders() if args.decode_ablation else None
    runs: list[dict[str, Any]] = []
    for trace in family:
        load, res = decode_stress(trace, dcfg, POLICY_NAMES, args.decode_utilization, extra=extra)
        progress(f"{trace.name} (rows {len(trace)}) decode balance at {load}: {res}")
        runs.append({"load": load, "policies": res})
    mean = {name: {k: statistics.fmean(run["policies"][name][k] for run in runs) for k in r}
            for name, r in runs[0]["policies"].items()}  # fmt: skip
    label = family[0].name + (f" (decode, mean of {len(family)} seeds)" if len(family) > 1 else " (decode)")
    for name, r in mean.items():
        report.rows.append({"trace": label, "policy": name, **{k: r[k] for k in DECODE_KEYS}})
    s = mean["sluice"]
    paired: dict[str, Any] = {}
    # step balance two ways: of each engine's time-averaged step, and at each instant (what
    # the ranks of an EP decode instance feel: they step together, at the slowest one's pace)
    for key in ("step_max_over_mean", "step_instant_max_over_mean", "tpot_p99_ms"):
        peer = min(BASELINES, key=lambda name: mean[name][key])
        report.target(f"{label}: sluice {key} / best peer's", s[key] / mean[peer][key], "<=", 1.0)
        if len(runs) > 1:
            paired[key] = paired_difference(
                [run["policies"]["sluice"][key] for run in runs], [run["policies"][peer][key] for run in runs]
            ) | {"peer": peer}
    if len(family) == 1:
        return {"policies": mean, "load": runs[0]["load"]}
    return {"policies": mean, "per_seed": runs, "paired_vs_best_peer": paired}


def paired_difference(ours: list[float], peer: list[float]) -> dict[str, Any]:
    """Seed-by-seed ``ours - peer`` (lower is better for both): its mean, the standard error
    of that mean, and on how many seeds ours was lower. Both ran on the same trace per seed,
    so the difference removes what the seed does to every policy alike; a mean within about
    two standard errors of 0 is not told apart from a tie by these seeds."""
    d = [a - b for a, b in zip(ours, peer, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return {"mean_diff": statistics.fmean(d), "stderr": se, "seeds": len(d),
            "ours_lower_on": sum(x < 0 for x in d)}  # fmt: skip


def _ablation_builders() -> dict[str, Any]:
    """sluice's decode balancer under each of its rules (TwoDimConfig.rule)."""
    from router.sluice import DECODE_RULES, TwoDimConfig, TwoDimDecode

    def make(rule: str) -> Any:
        return lambda ctx: TwoDimDecode(ctx, TwoDimConfig(rule=rule))

    return {f"sluice[{rule}]": make(rule) for rule in DECODE_RULES}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("hit_rate / hit_rate_inf", "ttft_p50_s", "ttft_p99_s", "tpot_p99_ms", "throughput_tok_s",
            "throughput / reference_throughput", "prefill_balance_max_over_mean")  # fmt: skip
    return {k: r[k] for k in keys if k in r}


def _targets(
    report: Report, name: str, res: dict[str, dict[str, Any]], peers: tuple[str, ...] = BASELINES
) -> None:
    s = res["sluice"]
    report.target(
        f"{name}: sluice throughput / reference_throughput",
        s["throughput / reference_throughput"],
        ">=",
        0.85,
    )
    report.target(f"{name}: sluice hit_rate / hit_rate_inf", s["hit_rate / hit_rate_inf"], ">=", 0.9)
    for peer in peers:
        report.target(
            f"{name}: sluice ttft_p99_s / {peer} ttft_p99_s",
            s["ttft_p99_s"] / res[peer]["ttft_p99_s"],
            "<",
            1.0,
        )


def _run_peer(args: argparse.Namespace, report: Report, subset: Any, cfg: Any) -> None:
    from services.bench._router_peer import PeerUnavailable, compare_with_sglang

    name = f"{subset.name}[:{len(subset)}]"
    try:
        res = compare_with_sglang(subset, cfg, args.load, args.offline_load, args.peer_seconds, progress)
    except PeerUnavailable as exc:
        progress(f"sglang-router peer not run on {name}: {exc}")
        report.results[name] = {"sglang_router_error": str(exc)}
        return
    report.results[name] = res
    for pol, r in res["policies"].items():
        report.rows.append({"trace": name, "policy": pol, **_row(r)})
    s, g = res["policies"]["sluice"], res["policies"]["sglang_router"]
    report.target(
        f"{name}: sluice ttft_p99_s / sglang_router ttft_p99_s", s["ttft_p99_s"] / g["ttft_p99_s"], "<", 1.0
    )


def main() -> None:
    """``python -m services.bench.router`` (same as ``sluice bench router``), for hosts that
    lack the CLI's service dependencies (the GPU machine's ``--profile-decode --device cuda``)."""
    module_main("router", add_arguments, run, None)


if __name__ == "__main__":
    main()
