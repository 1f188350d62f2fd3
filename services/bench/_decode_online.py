"""``sluice bench router --online-fit``: does the decode cost model refitted while serving
(``costmodel.online``) predict an engine's decode steps, on a workload it did not see?

On this machine, with one checkpoint (default ``models/trained``):

1. **The profiled table** (``profile_decode``, as ``sluice bench engine --profile`` measures
   it) over the batch sizes and depths the workloads reach, and its fit: the router's model
   when someone has profiled.
2. **Two served workloads of different shapes**, each through a fresh ``EngineCore`` (the
   engine the pools run) under a concurrency that steps up 1, 4, 8, 16, 32: ``chat``
   (prompts log-uniform 32-1,024 tokens, answers 24-96) and ``documents`` (prompts
   1,024-8,192, answers 16-48). Each engine's decode steps are summed as it pushes them to
   the router (``DecodeStepSums``). ``--speculative POLICY``: the engines speculate, so their
   steps verify drafts and draft the next ones, which the table of plain decode steps does
   not time; the refits follow the steps the engines ran.
3. **Each model graded on each workload's steps** by its relative RMS error: the default
   (H200-derived), the table's fit, and each of those two refitted on each workload's
   steps (graded on the other workload: held out), as the router refits them: the default
   whole when no table was measured beside the checkpoint; the table's fit keeping its
   ``d2`` when one was, or refitted whole (``d2 free``) where the engines speculate
   (``services.ray.decode_set``). Each model's crossover length ``d1 / d2`` too: it is what
   the 2D rule takes from the model.

Prompts are seeded random ids (a step's cost depends on shapes, not on text).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from services.bench import Report, progress

CONCURRENCY = (1, 4, 8, 16, 32)
WORKLOADS: dict[str, dict[str, tuple[int, int]]] = {
    "chat": {"prompt": (32, 1024), "output": (24, 96)},
    "documents": {"prompt": (1024, 8192), "output": (16, 48)},
}
TABLE_BATCH = (1, 2, 4, 8, 16, 32)
TABLE_KV = (0, 2_048, 16_384, 65_536, 262_144)  # KV tokens in a step, over all its sequences
TABLE_MAX_DEPTH = 8_192 + 48  # the deepest sequence the workloads make: fitted cells are no deeper


def _serve(
    model_dir: Path, shape: dict[str, tuple[int, int]], seed: int, speculative: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Run ``shape``'s requests through an engine at each concurrency of ``CONCURRENCY``
    (2 x c requests per phase, c kept in flight); its summed decode steps and what ran."""
    from engine.core import CoreRequest, EngineConfig, EngineCore
    from engine.sampling.params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = _vocab(model_dir)
    plo, phi = shape["prompt"]
    olo, ohi = shape["output"]
    max_c = max(CONCURRENCY)
    blocks = max_c * (-(-(phi + ohi) // 256) + 1) + 8
    core = EngineCore(
        EngineConfig(
            model=str(model_dir), max_num_seqs=max_c, num_swa_slots=max_c, num_blocks=blocks,
            enable_prefix_caching=False, speculative=speculative,
        )
    )  # fmt: skip
    t0 = time.perf_counter()
    served: dict[str, float] = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "steps": 0}
    try:
        n = 0
        for c in CONCURRENCY:
            todo, live = 2 * c, 0
            while todo or live:
                while todo and live < c:
                    length = int(round(math.exp(rng.uniform(math.log(plo), math.log(phi)))))
                    out = int(rng.integers(olo, ohi + 1))
                    ids = tuple(int(x) for x in rng.integers(2, vocab, length))
                    core.add(CoreRequest(f"w{n}", ids, SamplingParams(max_tokens=out, ignore_eos=True)))
                    served["requests"] += 1
                    served["prompt_tokens"] += length
                    served["output_tokens"] += out
                    n, todo, live = n + 1, todo - 1, live + 1
                for msg in core.step():
                    live -= msg.finish_reason is not None
            progress(
                f"  concurrency {c}: {core.decode_steps.w:.0f} decode steps so far, "
                f"{time.perf_counter() - t0:.0f} s"
            )
        served["steps"] = core.loop.steps
    finally:
        core.close()
    served["wall_s"] = round(time.perf_counter() - t0, 1)
    return core.decode_steps, served


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def run_online_fit(
    model_dir: Path, rounds: int, repeats: int, seed: int, speculative: str | None = None
) -> Report:
    from costmodel import DecodeCostModel
    from costmodel.online import posterior
    from router.steptable import StepTable
    from services.bench._router_profile import profile_decode

    report = Report("router", config={
        "mode": "online-fit", "model": str(model_dir), "concurrency": list(CONCURRENCY),
        "workloads": {k: {kk: list(vv) for kk, vv in v.items()} for k, v in WORKLOADS.items()},
        "table_batch": list(TABLE_BATCH), "table_kv_tokens": list(TABLE_KV), "table_max_depth": TABLE_MAX_DEPTH,
        "rounds": rounds, "repeats": repeats, "seed": seed, "speculative": speculative,
    })  # fmt: skip
    progress(f"profiled table: batches {TABLE_BATCH} x KV {TABLE_KV} ({rounds} rounds x {repeats} steps)")
    table_raw = profile_decode(
        model_dir=model_dir, batches=TABLE_BATCH, kv_tokens=TABLE_KV, rounds=rounds, repeats=repeats
    )
    # fitted over the cells whose sequences are no deeper than the workloads' (as the serving
    # client fits over the cells its engines can reach)
    table = StepTable.from_dict(table_raw)
    fitted = table.fit(TABLE_MAX_DEPTH)
    steps, served = {}, {}
    for i, (name, shape) in enumerate(WORKLOADS.items()):
        progress(f"serving '{name}' (prompts {shape['prompt']}, answers {shape['output']})")
        steps[name], served[name] = _serve(model_dir, shape, seed + i, speculative)
    default = DecodeCostModel()
    models = {"default": default, "table fit": fitted}
    for name in WORKLOADS:
        models[f"refit of default on {name}"] = posterior(default, steps[name])
        models[f"refit of table fit on {name}"] = posterior(fitted, steps[name], keep_d2=True)
        # what placement uses where the engines speculate (services.ray.decode_set)
        models[f"refit of table fit, d2 free, on {name}"] = posterior(fitted, steps[name])
    report.results["table"] = {
        "cells": len(table.samples(TABLE_MAX_DEPTH)),
        "fit": fitted.to_json(),
        "wall_s": table_raw["wall_s"],
    }
    report.results["served"] = served
    report.results["step_sums"] = {name: steps[name].to_extra() for name in WORKLOADS}
    report.results["models"] = {k: v.to_json() for k, v in models.items()}
    # what the 2D rule takes from a model: its crossover length d1 / d2 (docs/router.md)
    report.results["crossover_tokens"] = {k: _crossover(v) for k, v in models.items()}
    errors: dict[str, dict[str, float]] = {}
    for wl in WORKLOADS:
        errors[wl] = {label: steps[wl].rel_rmse(m) for label, m in models.items()}
        report.rows.append({
            "steps of": wl, "decode steps": round(steps[wl].w),
            "mean batch": round(steps[wl].batch / steps[wl].w, 1),
            "mean KV tokens": round(steps[wl].kv / steps[wl].w),
            **{label: round(e, 3) for label, e in errors[wl].items()},
        })  # fmt: skip
    report.rows.append({
        "steps of": "crossover d1/d2 (tokens)",
        **{label: round(c) if math.isfinite(c) else "inf" for label, c in report.results["crossover_tokens"].items()},
    })  # fmt: skip
    report.results["rel_rmse"] = errors
    for wl in WORKLOADS:
        other = next(o for o in WORKLOADS if o != wl)
        e = errors[wl]
        # no profile: the default refitted on the other workload's steps
        held_out = e[f"refit of default on {other}"]
        report.target(f"{wl} steps: default refit on {other} (held out) vs half the default's", held_out, "<=",
                      0.5 * e["default"])  # fmt: skip
        report.target(f"{wl} steps: default refit on {other} (held out) vs the table's fit", held_out, "<=",
                      e["table fit"])  # fmt: skip
        # profiled: serving refits the table's fit (its d2 kept unless the engines speculate);
        # it must not predict worse than the fit alone
        free = ", d2 free," if speculative else ""
        report.target(f"{wl} steps: table fit refit{free} on {other} (held out) vs the table's fit",
                      e[f"refit of table fit{free} on {other}"], "<=", e["table fit"])  # fmt: skip
    return report


def _crossover(model: Any) -> float:
    return model.d1 / model.d2 if model.d2 > 0 else math.inf
