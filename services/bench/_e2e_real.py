"""The ``real`` section of ``sluice bench e2e``: colocated vs disaggregated on real processes
of this machine (a loopback Ray instance, a ``LocalStore`` KV store, two engine actors per
configuration driven through ``RayServingClient``), each configuration replaying the scaled
trace and then probing at low load; the workload and the measures are in ``e2e.py``'s
docstring. Also the handoff byte formula the ``handoff_131k`` section reuses
(``_handoff_bytes``)."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.bench import Report, progress
from services.bench._e2e_trace import (
    TOKEN_HIGH,
    TOKEN_LOW,
    TRACE_BLOCK_TOKENS,
    Timing,
    TraceRequest,
    block_run,
    latency_summary,
    load_trace,
    scale_trace,
    scaled_block,
)

# the disaggregated configuration of each handoff transport (services/ray/handoff.py)
DISAGGREGATED = {"object_store": "disaggregated", "grpc": "disaggregated_grpc"}
PROBE_REPS = 3
PROBE_MAX_TOKENS = 4
T2_TARGET = 1.1


def configs_of(args: argparse.Namespace) -> tuple[str, ...]:
    """colocated, then one disaggregated configuration per ``--transports`` entry."""
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in names if t not in DISAGGREGATED]
    if unknown or not names:
        raise ValueError(f"--transports: give some of {', '.join(DISAGGREGATED)}, got {args.transports!r}")
    return ("colocated", *(DISAGGREGATED[t] for t in dict.fromkeys(names)))


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from engine.checkpoint.presets import resolve_preset
    from services import envs

    return resolve_preset(args.preset, envs.HOME.get())


async def _send(client: Any, request: Any, timing: Timing, timeout_s: float) -> None:
    """Submit ``request`` and stamp each token; a busy pool (``EngineBusy``: nothing held)
    is retried after a short back-off within the same deadline."""
    from services.api.engine_client import EngineBusy

    timing.submit = time.perf_counter()
    deadline = timing.submit + timeout_s

    async def consume() -> None:
        while True:
            try:
                async for out in client.generate(request):
                    now = time.perf_counter()
                    timing.token_times.extend([now] * len(out.token_ids))
                return
            except EngineBusy:
                if timing.token_times:
                    raise
                timing.busy_retries += 1
                await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(consume(), max(0.0, deadline - time.perf_counter()))
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        timing.error = f"{request.request_id}: {type(exc).__name__}: {exc}"
    else:
        if len(timing.token_times) != request.max_tokens:
            timing.error = (
                f"{request.request_id}: {len(timing.token_times)} tokens, expected {request.max_tokens}"
            )


def _request(rid: str, prompt: Sequence[int], max_tokens: int) -> Any:
    from services.api.engine_client import EngineRequest

    return EngineRequest(rid, tuple(prompt), max_tokens, temperature=0.0, ignore_eos=True)


async def _replay(client: Any, name: str, reqs: Sequence[TraceRequest], timeout_s: float) -> dict[str, Any]:
    timings = [Timing(f"{name}-r{r.index}", len(r.prompt)) for r in reqs]
    t0 = time.perf_counter()
    finished = 0

    async def one(r: TraceRequest, timing: Timing) -> None:
        nonlocal finished
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        await _send(client, _request(timing.request_id, r.prompt, r.max_tokens), timing, timeout_s)
        finished += 1
        state = "FAILED " + timing.error if timing.error else (
            f"ttft {timing.ttft:.3f} s, t2 {timing.t2 * 1e3:.1f} ms, tpot {timing.tpot * 1e3:.1f} ms"
        )  # fmt: skip
        progress(
            f"{name} replay {finished}/{len(reqs)}: #{r.index} ({len(r.prompt)} in, {r.max_tokens} out) {state}"
        )

    await asyncio.gather(*(one(r, t) for r, t in zip(reqs, timings)))
    ok = [t for t in timings if t.error is None]
    end = max((t.done for t in ok), default=t0)
    makespan = end - t0
    out = latency_summary(timings)
    out["makespan_s"] = makespan
    out["throughput_tok_s"] = out["output_tokens"] / makespan if makespan > 0 else math.nan
    out["per_request"] = [
        {"id": t.request_id, "prompt_tokens": t.prompt_tokens, "output_tokens": len(t.token_times),
         "ttft_s": t.ttft, "t2_s": t.t2, "tpot_s": t.tpot, "busy_retries": t.busy_retries}
        for t in timings
    ]  # fmt: skip
    return out


async def _probe(
    client: Any, name: str, n_tokens: int, vocab: int, seed: int, timeout_s: float
) -> dict[str, Any]:
    timings = []
    for rep in range(PROBE_REPS):
        # a prompt new to every engine and to the store: nothing is served from a cache
        prompt = block_run(-1 - rep, n_tokens, f"{seed}:{name}:probe", vocab)
        timing = Timing(f"{name}-probe{rep}", n_tokens)
        await _send(client, _request(timing.request_id, prompt, PROBE_MAX_TOKENS), timing, timeout_s)
        timings.append(timing)
        progress(
            f"{name} probe {rep + 1}/{PROBE_REPS} ({n_tokens} tokens): "
            + (
                f"FAILED {timing.error}"
                if timing.error
                else f"ttft {timing.ttft:.3f} s, t2 {timing.t2 * 1e3:.1f} ms"
            )
        )
    out = latency_summary(timings)
    out["prompt_tokens"] = n_tokens
    out["t2_s_each"] = [t.t2 for t in timings]
    out["ttft_s_each"] = [t.ttft for t in timings]
    return out


def _handoff_counters(client: Any) -> tuple[float, float]:
    if client.decode is None:
        return 0.0, 0.0
    stats = [r.stats().extra for r in client.decode.replicas]
    return sum(s.get("handoff_bytes_in", 0.0) for s in stats), sum(s.get("handoffs_in", 0.0) for s in stats)


async def _settled_counters(client: Any, before: tuple[float, float], expected: int) -> tuple[float, float]:
    """The decode engines' handoff counters once their pushes show ``expected`` new handoffs
    (pushed every 10 ms; at most 5 s)."""
    deadline = time.monotonic() + 5.0
    now = _handoff_counters(client)
    while now[1] - before[1] < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = _handoff_counters(client)
    return now[0] - before[0], now[1] - before[1]


async def _run_config(
    name: str, model: Path, engine_cfg: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    from services.ray.handoff import HandoffConfig
    from services.ray.serving import PoolConfig, RayServingClient

    if name == "colocated":
        pools = (PoolConfig(2, engine_cfg, resources={"prefill": 1}), PoolConfig(0))
    else:
        pools = (
            PoolConfig(1, engine_cfg, resources={"prefill": 1}),
            PoolConfig(1, engine_cfg, resources={"decode": 1}),
        )
    handoff = HandoffConfig(transport="grpc" if name == DISAGGREGATED["grpc"] else "object_store")
    client = RayServingClient(model, *pools, handoff=handoff)
    t_start = time.perf_counter()
    await client.start()
    started_s = time.perf_counter() - t_start
    info = client.model_info()
    progress(f"{name}: {len(client.actors)} engines up in {started_s:.1f} s (context {info.context_limit})")
    try:
        reqs = scale_trace(
            rows, args.scale, args.time_scale, info.context_limit, f"{args.seed}:{name}", info.vocab_size
        )
        # warm-up (untimed): the first steps of each engine allocate; two at once reach both
        warm = [Timing(f"{name}-warm{i}", 64) for i in range(2)]
        await asyncio.gather(*(
            _send(client, _request(w.request_id, block_run(-100 - i, 64, f"{args.seed}:{name}:warm", info.vocab_size), 4),
                  w, args.request_timeout)
            for i, w in enumerate(warm)
        ))  # fmt: skip
        failed = [w.error for w in warm if w.error]
        if failed:
            raise RuntimeError(f"{name}: warm-up failed: {failed}")
        before = _handoff_counters(client)
        progress(f"{name}: replaying {len(reqs)} requests over {reqs[-1].arrival_s:.1f} s of arrivals")
        replay = await _replay(client, name, reqs, args.request_timeout)
        handed = [r for r, p in zip(reqs, replay["per_request"]) if p["output_tokens"] >= 2]
        if client.disaggregated:
            replay["handoff_measured"] = await _settled_counters(client, before, len(handed))
        probe_tokens = min(args.probe_tokens, info.context_limit - PROBE_MAX_TOKENS - 1)
        probe = await _probe(client, name, probe_tokens, info.vocab_size, args.seed, args.request_timeout)
    finally:
        await client.close()
    return {
        "engines": {
            "prefill" if client.disaggregated else "colocated": pools[0].engines,
            "decode": pools[1].engines,
        },
        "start_s": started_s,
        "replay": replay,
        "probe": probe,
        "_handed_prompts": [len(r.prompt) for r in handed],
    }


def _handoff_bytes(
    model: Path, dtype: str, measured: tuple[float, float], prompts: list[int]
) -> dict[str, Any]:
    """Measured handoff bytes per handed-off request against the cache formula for the same
    prompt lengths (the sequence is exported after the prefill: its prompt is in the cache)."""
    import torch

    from engine.cache.spec import CacheSpec
    from engine.config import BLOCK_TOKENS, ModelConfig
    from engine.kvconnector import payload as fmt
    from services.bench.prefix import formula_bytes

    itemsize = getattr(torch, dtype).itemsize
    spec = CacheSpec.from_model(ModelConfig.from_dir(model), elem_bytes=itemsize, state_bytes=itemsize)
    f = formula_bytes(spec, fmt.HEADER_BYTES_BLOCK, BLOCK_TOKENS)
    total_bytes, count = measured
    n = len(prompts)
    mean_prompt = statistics.fmean(prompts) if prompts else math.nan
    paged = f["paged_bytes_per_token"] * mean_prompt
    slot = float(spec.slot_bytes())
    blocks = statistics.fmean(-(-p // BLOCK_TOKENS) for p in prompts) if prompts else math.nan
    block_rule = blocks * (f["paged_bytes_per_block"] + f["header_bytes_per_block"]) + slot
    per_request = total_bytes / count if count else math.nan
    return {
        "handoffs_in": count,
        "handed_off_requests": n,
        "handoff_bytes_in": total_bytes,
        "measured_bytes_per_request": per_request,
        "mean_prompt_tokens": mean_prompt,
        "formula_paged_bytes_per_token": f["paged_bytes_per_token"],
        "formula_paged_bytes_per_request": paged,
        "formula_slot_bytes_per_request": slot,
        "formula_bytes_per_request": paged + slot,
        "formula_rule": "paged_bytes_per_token (summed over layers) * prompt tokens + slot_bytes (one "
        "sequence's windows and compressor states)",
        "block_granular_bytes_per_request": block_rule,
        "block_granular_rule": "ceil(prompt / 256) * (paged_bytes_per_block + block header) + slot_bytes "
        "(the partial tail block travels whole)",
        "measured_over_formula": per_request / (paged + slot) if count else math.nan,
        "measured_over_block_granular": per_request / block_rule if count else math.nan,
        "measured_bytes_per_prompt_token": per_request / mean_prompt if count else math.nan,
    }


def run_real(args: argparse.Namespace, report: Report) -> None:
    """The ``real`` section: each configuration of ``configs_of`` in turn on one loopback Ray
    instance and one KV store, then the handoff bytes and t2 ratios, the rows and the targets."""
    import ray

    from kvstore.cluster import LocalClusterConfig
    from services.local.store import LocalStore
    from services.ray.local_cluster import init_local_ray

    if args.requests < 1:
        raise ValueError("--requests needs at least 1")
    configs = configs_of(args)
    model = _model_dir(args)
    rows = load_trace(args.trace, args.requests)
    report.config.update(_real_config(args, model, rows, configs))
    owns_ray = not ray.is_initialized()
    init_local_ray(num_cpus=2, resources={"prefill": 4, "decode": 4})
    t_start = time.perf_counter()
    try:
        with LocalStore(LocalClusterConfig(nodes=12)) as store:
            progress(f"store up (12 nodes + redis); model {model}")
            engine_cfg = {
                "num_blocks": args.num_blocks, "max_num_batched_tokens": args.chunk, "kv_store": str(store.spec_path)
            }  # fmt: skip
            for name in configs:
                report.results[name] = asyncio.run(_run_config(name, model, engine_cfg, args, rows))
    finally:
        if owns_ray:
            ray.shutdown()
    ratios = _handoffs_and_t2_ratios(report.results, model, configs)
    report.results["wall_s"] = time.perf_counter() - t_start
    _add_rows_and_targets(report, configs, ratios)


def _real_config(
    args: argparse.Namespace, model: Path, rows: list[dict[str, Any]], configs: tuple[str, ...]
) -> dict[str, Any]:
    """The ``real`` section's part of the report's config: scaling, engines, configurations."""
    block = scaled_block(args.scale)
    trace_span_s = (
        max(float(r["timestamp"]) for r in rows) - min(float(r["timestamp"]) for r in rows)
    ) / 1000.0
    return {
        "preset": None if args.model else args.preset, "model": str(model), "device": "cpu", "dtype": "float32",
        "trace": str(args.trace), "requests": args.requests,
        "scaling": {
            "token_scale": args.scale,
            "hash_block_tokens": f"{TRACE_BLOCK_TOKENS} in the trace -> {block} replayed",
            "input_tokens": "round(input_length * scale), trimmed to context - output - 1",
            "output_tokens": "max(2, round(output_length * scale))",
            "time_scale": args.time_scale,
            "trace_span_s": trace_span_s, "replay_arrival_span_s": trace_span_s * args.time_scale,
            "prompt_tokens": f"seeded runs of ids in [{TOKEN_LOW}, {TOKEN_HIGH}) per hash id "
            "(seed names the configuration: no KV-store hits across configurations)",
        },
        "engine": {"num_blocks": args.num_blocks, "max_num_batched_tokens": args.chunk},
        "configurations": {
            "colocated": "PoolConfig(2, engine, resources={'prefill': 1}) + PoolConfig(0): requests run whole",
            "disaggregated": "PoolConfig(1, engine, {'prefill': 1}) + PoolConfig(1, engine, {'decode': 1}), "
            "handoffs through Ray's object store",
            "disaggregated_grpc": "the same, handoffs over gRPC (HandoffConfig(transport='grpc'))",
            "run": list(configs),
        },
        "sampling": "greedy (temperature 0), ignore_eos",
        "probe": {"prompt_tokens_asked": args.probe_tokens, "reps": PROBE_REPS, "max_tokens": PROBE_MAX_TOKENS},
        "ray": "loopback, num_cpus=2, resources prefill 4 / decode 4",
        "store": "services.local.store.LocalStore: 12 node processes + redis-server",
        "request_timeout_s": args.request_timeout,
    }  # fmt: skip


def _handoffs_and_t2_ratios(
    results: dict[str, Any], model: Path, configs: tuple[str, ...]
) -> dict[str, float]:
    """Each disaggregated configuration's handoff bytes against the cache formula (its
    ``handoff``) and its probe's t2 median over colocated's: the ratios, by configuration, go
    to the results (``t2_ratio_low_load``, ``t2_ratio_low_load_grpc``) and are returned."""
    results["colocated"].pop("_handed_prompts")
    t2 = {n: results[n]["probe"]["t2_s"]["p50"] for n in configs}
    ratios: dict[str, float] = {}
    for name in configs[1:]:
        dis = results[name]
        prompts = dis.pop("_handed_prompts")
        dis["handoff"] = _handoff_bytes(model, "float32", dis["replay"].pop("handoff_measured"), prompts)
        ratios[name] = t2[name] / t2["colocated"] if t2["colocated"] > 0 else math.inf
    if "disaggregated" in ratios:
        results["t2_ratio_low_load"] = ratios["disaggregated"]
    if "disaggregated_grpc" in ratios:
        results["t2_ratio_low_load_grpc"] = ratios["disaggregated_grpc"]
    return ratios


def _add_rows_and_targets(report: Report, configs: tuple[str, ...], ratios: dict[str, float]) -> None:
    """One row per configuration; the t2 ratio targets, then no failed request per configuration."""
    for name in configs:
        rep, probe = report.results[name]["replay"], report.results[name]["probe"]
        hand = report.results[name].get("handoff")
        report.rows.append({
            "config": name, "done": f"{rep['completed']}/{rep['requests']}",
            "ttft_p50_s": rep["ttft_s"]["p50"], "ttft_p99_s": rep["ttft_s"]["p99"],
            "t2_p50_ms": rep["t2_s"]["p50"] * 1e3, "t2_p99_ms": rep["t2_s"]["p99"] * 1e3,
            "tpot_p50_ms": rep["tpot_s"]["p50"] * 1e3, "tpot_p99_ms": rep["tpot_s"]["p99"] * 1e3,
            "tok_s": rep["throughput_tok_s"],
            "probe_ttft_p50_s": probe["ttft_s"]["p50"], "probe_t2_p50_ms": probe["t2_s"]["p50"] * 1e3,
            "handoff_B/req": hand["measured_bytes_per_request"] if hand else "",
            "formula_B/req": hand["formula_bytes_per_request"] if hand else "",
        })  # fmt: skip
    # the probe's t2 median, disaggregated / colocated (results: each configuration's "probe")
    for name, ratio in ratios.items():
        report.target(
            "t2_ratio_low_load" + ("" if name == "disaggregated" else " (grpc)"), ratio, "<=", T2_TARGET
        )
    for name in configs:
        failed = report.results[name]["replay"]["failed"] + report.results[name]["probe"]["failed"]
        report.target(f"failed requests ({name})", failed, "==", 0)
