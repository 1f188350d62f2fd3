"""``sluice bench api --replicas N [--router-policy P]``: live routing over real HTTP clients.

The same shared-prefix workload is served twice, each time by a fresh server with N
in-process replicas of the checkpoint: once routed by ``round_robin`` (the baseline that
ignores caches) and once by ``P`` (default ``sluice``). ``groups`` prefixes of
``prefix_blocks`` full blocks each are shared by ``per_group`` requests (a unique suffix
each); the requests are shuffled (seeded) and sent by ``streams`` concurrent
``openai`` SDK clients on ``/v1/completions`` (token-id prompts, so the shared prefix is
exact). Reported per policy: prompt tokens the replicas served from their prefix caches
(the API's ``prompt_cache_hit_tokens``), requests and generated tokens per second, latency.

The router scores in seconds, so it is given the replicas' own prefill cost model, fitted in
this run on the same checkpoint (``services.bench.engine``'s grid), not the H200 defaults.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.bench import Report, progress

BLOCK = 256


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="> 1: compare routing policies over this many replicas instead",
    )
    p.add_argument(
        "--router-policy", default="sluice", help="with --replicas: the policy compared to round_robin"
    )
    p.add_argument("--groups", type=int, default=8, help="with --replicas: distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=4, help="with --replicas: requests sharing each prefix")
    p.add_argument(
        "--prefix-blocks", type=int, default=3, help="with --replicas: 256-token blocks per prefix"
    )


def workload(groups: int, per_group: int, prefix_blocks: int, suffix: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts in a seeded random order (a fixed interleave would let round_robin
    send each group to one replica by accident whenever ``groups`` is a multiple of N)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 1000) for _ in range(prefix_blocks * BLOCK)] for _ in range(groups)]
    prompts = [
        prefixes[g] + [rng.randrange(2, 1000) for _ in range(suffix)]
        for _ in range(per_group)
        for g in range(groups)
    ]
    rng.shuffle(prompts)
    return prompts


def _fit_cost_model(model: Path, out: Path) -> dict[str, Any]:
    from services.bench._engine_costmodel import GRID_C, GRID_H, fit_cost_model, profile_prefill

    fit = fit_cost_model(profile_prefill(model, "cpu", GRID_C, GRID_H, repeats=2))
    out.write_text(fit["model"].to_json())
    return {k: fit[k] for k in ("a", "b", "c", "d", "fit_rel_rmse")}


def _serve_workload(
    model: Path,
    replicas: int,
    policy: str,
    cost: Path,
    prompts: list[list[int]],
    streams: int,
    max_tokens: int,
) -> dict[str, Any]:
    import openai

    from services.api.app import create_app
    from services.api.config import ApiConfig
    from services.api.server import ServerThread
    from services.routing.client import RoutedEngineClient, RoutingConfig

    engine = RoutedEngineClient.in_process(model, RoutingConfig(replicas, policy, cost_model_path=cost))
    cfg = ApiConfig(max_concurrency=streams, max_queue=len(prompts), queue_timeout_s=600)
    app = create_app(cfg, engine)
    with ServerThread(app, app.state.sluice.config) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", timeout=600, max_retries=0)

        def one(prompt: list[int]) -> tuple[int, int, int, float]:
            t0 = time.monotonic()
            r = client.completions.create(
                model="deepseek-chat", prompt=prompt, max_tokens=max_tokens, temperature=0
            )
            if r.usage is None:
                raise RuntimeError("a completion came back without usage")
            hit = int((r.usage.model_extra or {}).get("prompt_cache_hit_tokens", 0))
            return r.usage.prompt_tokens, hit, r.usage.completion_tokens, time.monotonic() - t0

        one([2, 3, 4])  # warm-up: no full block, so it leaves nothing cached
        before = list(engine.routed)
        t0 = time.monotonic()
        with ThreadPoolExecutor(streams) as pool:
            rows = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
        routed = [a - b for a, b in zip(engine.routed, before)]
    prompt_tokens = sum(r[0] for r in rows)
    hits = sum(r[1] for r in rows)
    return {
        "requests": len(rows),
        "wall_s": wall,
        "requests_per_s": len(rows) / wall,
        "completion_tokens_per_s": sum(r[2] for r in rows) / wall,
        "prompt_tokens": prompt_tokens,
        "prefix_hit_tokens": hits,
        "hit_ratio": hits / prompt_tokens,
        "latency_p50_s": statistics.median(r[3] for r in rows),
        "latency_max_s": max(r[3] for r in rows),
        "routed_per_replica": routed,
    }


def run_routing(args: argparse.Namespace, model: Path) -> Report:
    import logging

    from services.routing.client import RoutingConfig

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the openai SDK's client: a line per request
    policy = RoutingConfig(args.replicas, args.router_policy).resolve().policy  # validates both
    config: dict[str, Any] = {
        "model": str(model), "replicas": args.replicas, "policies": ["round_robin", policy],
        "groups": args.groups, "per_group": args.per_group, "prefix_blocks": args.prefix_blocks,
        "suffix_tokens": 64, "streams": args.streams, "max_tokens": args.max_tokens,
    }  # fmt: skip
    report = Report("api", config)
    prompts = workload(args.groups, args.per_group, args.prefix_blocks, 64)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-route-") as tmp:
        cost_path = Path(tmp) / "cost.json"
        progress("fitting the replicas' prefill cost model")
        cost = _fit_cost_model(model, cost_path)
        results: dict[str, Any] = {"cost_model": cost}
        for name in ("round_robin", policy):
            progress(f"{len(prompts)} shared-prefix requests over {args.replicas} replicas, {name}")
            results[name] = _serve_workload(
                model, args.replicas, name, cost_path, prompts, args.streams, args.max_tokens
            )
    report.results = results
    base, ours = results["round_robin"], results[policy]
    report.rows = [
        {"policy": name, **{k: v for k, v in results[name].items() if k != "routed_per_replica"},
         "routed": "/".join(str(x) for x in results[name]["routed_per_replica"])}
        for name in ("round_robin", policy)
    ]  # fmt: skip
    # each group's first request must miss: at best every later one hits its whole prefix
    shared_after_first = args.groups * (args.per_group - 1) * args.prefix_blocks * BLOCK
    report.target(
        f"prefix_hit_tokens {policy} / round_robin",
        ours["prefix_hit_tokens"] / max(base["prefix_hit_tokens"], 1),
        ">=", 1.5,
    )  # fmt: skip
    report.target(
        f"prefix_hit_tokens {policy} / shared_prefix_tokens_after_first",
        ours["prefix_hit_tokens"] / shared_after_first,
        ">=", 0.5,
    )  # fmt: skip
    report.target(
        f"requests_per_s {policy} / round_robin", ours["requests_per_s"] / base["requests_per_s"], ">=", 1.0
    )
    return report
