"""Router policies on Mooncake traces (simulated engines) and decision latency (--micro).

Trace mode: every policy (and the SGLang router binary as a peer, unless --no-sglang) is
replayed against the same simulated prefill/decode pools; see docs/router.md for the
metric definitions. --micro: p99 latency of one in-process routing decision with 100,000
indexed blocks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.bench import Report, progress

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = (
    REPO / "data/traces/conversation_trace.jsonl",
    REPO / "data/traces/synthetic_trace.jsonl",
)
BASELINES = ("round_robin", "least_load", "cache_aware")


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


def run(args: argparse.Namespace) -> Report:
    if args.micro:
        return _run_micro()
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
    from router.evaluate import POLICY_NAMES, decode_stress, evaluate
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
        "traces": [], "sglang_peer": not args.no_sglang, "peer_requests": args.peer_requests,
    }  # fmt: skip
    report = Report("router", config=config)
    for path in _traces(args):
        trace = load_trace(path, limit=args.limit)
        config["traces"].append(str(path))
        ref, res = evaluate(trace, cfg, POLICY_NAMES, args.load, args.offline_load, progress=progress)
        stress = decode_stress(trace, cfg)
        progress(f"{trace.name} decode stress: {stress}")
        report.results[trace.name] = {
            "reference": ref.__dict__ | {"rows": len(trace)}, "policies": res, "decode_stress": stress,
        }  # fmt: skip
        for name, r in res.items():
            report.rows.append({"trace": trace.name, "policy": name, **_row(r)})
        for name, r in stress.items():
            report.rows.append({"trace": f"{trace.name} (decode stress)", "policy": name, **r})
        _targets(report, trace.name, res)
        if not args.no_sglang:
            _run_peer(args, report, trace.head(min(args.peer_requests, len(trace))), cfg)
    return report


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
