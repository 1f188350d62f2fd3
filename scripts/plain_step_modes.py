"""Plain decoding at 128 requests on an H100 runs ~3.3 or ~5.2-5.9 ms a step, engine by
engine. This runs fresh engines of `sluice bench spec`'s runs in turn (plain decoding, and
DSpark, which turns speculation off there) and prints, for each, its step median, the host
CPU time of its `EngineCore.step` calls (thread and process, averaged over every step,
prefill included), the steps it launched while the one before was on the device
(`EngineLoop.pipelined`), its CUDA graph replays and captures, and its Python threads; the
runs' figures go to a JSON file.

    python3 scripts/plain_step_modes.py OUT.json    # on a GPU, from the repository root
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import services.bench._spec_run as spec_run
from engine.core import EngineCore
from engine.prompts import heldout_prompts, phase_period, staggered

MODEL = Path("models/trained")
RUNS = [(128, p) for p in ("none", "none", "dspark", "none", "none", "dspark", "none")] + [(60, "none")]


def main() -> None:
    cpu = {"thread": 0.0, "process": 0.0}
    step, results = EngineCore.step, spec_run._results

    def timed_step(self: EngineCore) -> Any:
        t0, p0 = time.thread_time(), time.process_time()
        try:
            return step(self)
        finally:
            cpu["thread"] += time.thread_time() - t0
            cpu["process"] += time.process_time() - p0

    def with_loop(core: EngineCore, *args: Any) -> dict[str, Any]:
        out = results(core, *args)
        graphs = core.runner.graphs
        out["loop_steps"], out["pipelined"] = core.loop.steps, core.loop.pipelined
        out["replays"] = graphs.replays if graphs else None
        out["captures"] = graphs.captures if graphs else None
        out["threads"] = sorted(t.name for t in threading.enumerate())
        return out

    EngineCore.step = timed_step  # type: ignore[method-assign]
    spec_run._results = with_loop  # type: ignore[assignment]
    prompts = staggered(heldout_prompts(MODEL, 128, 256), phase_period(MODEL))
    engine = {"device": "cuda", "dtype": "bfloat16", "async_scheduling": None}
    rows = []
    for c, policy in RUNS:
        cpu["thread"] = cpu["process"] = 0.0
        r = spec_run.run_policy(MODEL, prompts[:c], 48, policy, None, engine, warmup_tokens=16, concurrency=c)
        n = r["loop_steps"]
        r.update(host_thread_ms=cpu["thread"] * 1e3 / n, host_process_ms=cpu["process"] * 1e3 / n)
        print(
            f"{c} {policy}: {r['tokens_per_s']:.0f} tok/s, median step {r['step_ms_median']:.2f} ms, host "
            f"{r['host_thread_ms']:.1f} ms a step ({r['host_process_ms']:.1f} process), pipelined "
            f"{r['pipelined']} of {n}, replays {r['replays']}, captures {r['captures']}, threads {r['threads']}",
            flush=True,
        )
        rows.append({"c": c, "policy": policy, **{k: v for k, v in r.items() if not k.startswith("_")}})
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
