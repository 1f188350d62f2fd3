"""Plain decoding at 128 requests on an H100 runs ~3.3 or ~5.2-5.9 ms a step, engine by
engine. This runs fresh engines of `sluice bench spec`'s runs in turn (plain decoding, and
DSpark, which turns speculation off there) and prints, for each, its step median, the host
CPU time of its timed round's `EngineCore.step` calls a step (thread and process), the
device time of its timed round's graph replays a step (CUDA events around each replay), the
steps it launched while the one before was on the device (`EngineLoop.pipelined`), its CUDA
graph replays and captures, and its Python threads; the runs' figures go to a JSON file. A
slow engine whose replays take as long as its steps is slow on the device; one whose
replays take a fast engine's time is slow on the host.

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
    import torch

    cpu = {"thread": 0.0, "process": 0.0}
    timing = [False]  # inside the timed round
    events: list[tuple[Any, Any]] = []
    step, results, timed_round = EngineCore.step, spec_run._results, spec_run._timed_round
    replay = torch.cuda.CUDAGraph.replay

    def timed_step(self: EngineCore) -> Any:
        if not timing[0]:
            return step(self)
        t0, p0 = time.thread_time(), time.process_time()
        try:
            return step(self)
        finally:
            cpu["thread"] += time.thread_time() - t0
            cpu["process"] += time.process_time() - p0

    def timed_replay(graph: Any) -> Any:
        if not timing[0]:
            return replay(graph)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(graph)
        end.record()
        events.append((start, end))
        return out

    def in_timed_round(*args: Any, **kwargs: Any) -> Any:
        timing[0] = True
        try:
            return timed_round(*args, **kwargs)
        finally:
            timing[0] = False

    def with_loop(core: EngineCore, *args: Any) -> dict[str, Any]:
        out = results(core, *args)
        graphs = core.runner.graphs
        out["loop_steps"], out["pipelined"] = core.loop.steps, core.loop.pipelined
        out["replays"] = graphs.replays if graphs else None
        out["captures"] = graphs.captures if graphs else None
        out["threads"] = sorted(t.name for t in threading.enumerate())
        return out

    EngineCore.step = timed_step  # type: ignore[method-assign]
    torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign,assignment]
    spec_run._results = with_loop  # type: ignore[assignment]
    spec_run._timed_round = in_timed_round
    prompts = staggered(heldout_prompts(MODEL, 128, 256), phase_period(MODEL))
    engine = {"device": "cuda", "dtype": "bfloat16", "async_scheduling": None}
    rows = []
    for c, policy in RUNS:
        cpu["thread"] = cpu["process"] = 0.0
        events.clear()
        r = spec_run.run_policy(MODEL, prompts[:c], 48, policy, None, engine, warmup_tokens=16, concurrency=c)
        n = r["decode_steps"] + 1  # the timed round's steps, its first (prefill) included
        torch.cuda.synchronize()
        replays_ms = sorted(a.elapsed_time(b) for a, b in events)
        r.update(
            host_thread_ms=cpu["thread"] * 1e3 / n, host_process_ms=cpu["process"] * 1e3 / n,
            replay_ms_median=replays_ms[len(replays_ms) // 2] if replays_ms else None,
        )  # fmt: skip
        print(
            f"{c} {policy}: {r['tokens_per_s']:.0f} tok/s, median step {r['step_ms_median']:.2f} ms, replay "
            f"{r['replay_ms_median']} ms (median), host "
            f"{r['host_thread_ms']:.2f} ms a step ({r['host_process_ms']:.2f} process), pipelined "
            f"{r['pipelined']} of {r['loop_steps']}, replays {r['replays']}, captures {r['captures']}, threads {r['threads']}",
            flush=True,
        )
        rows.append({"c": c, "policy": policy, **{k: v for k, v in r.items() if not k.startswith("_")}})
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
