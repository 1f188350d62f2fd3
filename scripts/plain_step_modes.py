"""Plain decoding at 128 requests on an H100 runs ~3.3 or ~5.2-5.9 ms a step, engine by
engine. This runs fresh engines of `sluice bench spec`'s runs in turn (plain decoding, and
DSpark, which turns speculation off there) and prints, for each, its step median, the host
CPU time of its timed round's `EngineCore.step` calls (median a step, thread and process), the
device time of its timed round's graph replays a step (CUDA events around each replay), the
steps it launched while the one before was on the device (`EngineLoop.pipelined`), its CUDA
graph replays and captures, and its Python threads; the runs' figures go to a JSON file. A
slow engine whose replays take as long as its steps is slow on the device; one whose
replays take a fast engine's time is slow on the host. For timed steps 30-37 (``PROFILED``)
torch's profiler records each engine's device work by kernel (ms and calls a step, the
median step left out of that window beside it), and the GPU's clocks, temperature and power
are read before and after each engine: a slow engine that runs other kernels, or the same
ones longer at the same clocks, is told apart from a throttled GPU.

    python3 scripts/plain_step_modes.py OUT.json            # on a GPU, from the repository root
    python3 scripts/plain_step_modes.py OUT.json --smoke    # one small plain run on the CPU

Each engine's host side is broken down too: the host wall time of its replay() calls
(``cudaGraphLaunch``; for five of them, ``IDLE_LAUNCHES``, the device is synchronized first,
so that a launch that waits for room behind the step before shows against one that does
not), the mean ms a step inside each of `sluice bench host --phases`' phases,
and a fixed pure-Python workload's median ms before and after it (``probe``): a slow engine
whose phases are all slower on a slower probe ran on a slower host; one slow in one phase
points at that phase.

The slow mode is the host's (session 56: the replays take the same device time in every
engine). ``--probe-steps`` runs a small probe after every timed step (it lengthens the host's side of
each step by ~0.3 ms): where the host's own speed changes, the probe slows with the steps.
``--gc-off`` tests one cause on the host: it freezes what exists and turns Python's
cyclic collector off, so that no engine's steps pay for collecting another's garbage.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import services.bench._spec_run as spec_run
from engine.core import EngineCore
from engine.prompts import heldout_prompts, phase_period, staggered
from services.bench.host import PHASES, _phase_timers, probe_seconds

MODEL = Path("models/trained")
# timed-round steps (0-based) run under torch's profiler: each engine's device work by kernel
PROFILED = (30, 38)
# timed-round replays (0-based) launched with the device idle (synchronized first)
IDLE_LAUNCHES = (10, 15)
RUNS = (
    [(128, p) for p in ("none", "none", "dspark", "none", "none", "none")]
    + [(1, "fixed-5")] * 3
    + [(60, "none")]
)


def main() -> None:
    import torch

    # the timed round's `EngineCore.step` calls: wall, thread CPU and process CPU seconds
    walls: list[float] = []
    threads: list[float] = []
    processes: list[float] = []
    profiler: list[Any] = [None]
    kernels: list[dict[str, Any]] = []
    timing = [False]  # inside the timed round
    events: list[tuple[Any, Any]] = []
    launches: list[float] = []  # host wall seconds of each timed replay() call
    idle_launches: list[float] = []  # the same, of IDLE_LAUNCHES' replays, the device idle
    step_probes: list[float] = []  # a small fixed probe's ms after each timed step
    cpus: dict[int, int] = {}  # the CPU the main thread was on after each timed step -> steps
    step, results, timed_round = EngineCore.step, spec_run._results, spec_run._timed_round
    replay = torch.cuda.CUDAGraph.replay

    def timed_step(self: EngineCore) -> Any:
        if not timing[0]:
            return step(self)
        i = len(walls)
        if i == PROFILED[0]:
            profiler[0] = torch.profiler.profile(activities=[activity])
            profiler[0].__enter__()
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        try:
            return step(self)
        finally:
            walls.append(time.perf_counter() - w0)
            threads.append(time.thread_time() - t0)
            processes.append(time.process_time() - p0)
            cpu = _cpu_now()
            cpus[cpu] = cpus.get(cpu, 0) + 1
            if probe_steps:  # this thread's speed just after the step
                step_probes.append(round(probe_seconds() * 1e3, 4))
            if i == PROFILED[1] - 1 and profiler[0] is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profiler[0].__exit__(None, None, None)
                kernels[:] = _top_kernels(profiler[0], PROFILED[1] - PROFILED[0])
                profiler[0] = None

    def timed_replay(graph: Any) -> Any:
        if not timing[0]:
            return replay(graph)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        idle = IDLE_LAUNCHES[0] <= len(events) < IDLE_LAUNCHES[1]
        out, seconds = _launch(replay, graph, idle, start)
        (idle_launches if idle else launches).append(seconds)
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
    smoke = "--smoke" in sys.argv
    _host_settings(sys.argv)
    probe_steps = "--probe-steps" in sys.argv
    prompts = staggered(heldout_prompts(MODEL, 128, 256), phase_period(MODEL))
    engine = {
        "device": "cpu" if smoke else "cuda",
        "dtype": "float32" if smoke else "bfloat16",
        "async_scheduling": None,
    }
    activity = torch.profiler.ProfilerActivity.CPU if smoke else torch.profiler.ProfilerActivity.CUDA
    rows = []
    for c, policy in [(4, "none")] if smoke else RUNS:
        for buf in (events, launches, idle_launches, walls, threads, processes, kernels, cpus, step_probes):
            buf.clear()
        clocks, probe_before = _clocks(), _host_probe_ms()
        with _phase_timers(timing, PHASES) as spent:
            r = spec_run.run_policy(
                MODEL, prompts[:c], 48, policy, None, engine, warmup_tokens=16, concurrency=c
            )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        replays_ms = [a.elapsed_time(b) for a, b in events]
        r.update(
            # medians over the steps outside the profiled window (whose last step's CPU time
            # holds the profiler's own processing)
            host_thread_ms=_median(_unprofiled(threads, 1e3)), host_process_ms=_median(_unprofiled(processes, 1e3)),
            replay_ms_median=_median(replays_ms),
            # the steps outside the profiled window (whose host time the profiler lengthens)
            step_ms_unprofiled=_median(_unprofiled(walls, 1e3)),
            kernels=list(kernels), clocks_before=clocks, clocks_after=_clocks(),
            launch_ms_median=_median([x * 1e3 for x in launches]),
            idle_launch_ms_median=_median([x * 1e3 for x in idle_launches]),
            # the mean ms a timed step spends in each phase (profiled window included)
            phases_ms={k: round(sum(v) * 1e3 / max(1, len(walls)), 3) for k, v in spent.items()},
            probe_ms=(probe_before, _host_probe_ms()),
            # the steps' wall ms and the probe run after each: a slower host slows both
            steps_and_probes=[(round(w * 1e3, 3), p) for w, p in zip(walls, step_probes)],
            cpus=dict(sorted(cpus.items())),
        )  # fmt: skip
        print(
            f"{c} {policy}: {r['tokens_per_s']:.0f} tok/s, median step {r['step_ms_median']:.2f} ms, replay "
            f"{r['replay_ms_median']} ms (median), host "
            f"{r['host_thread_ms']:.2f} ms a step ({r['host_process_ms']:.2f} process), pipelined "
            f"{r['pipelined']} of {r['loop_steps']}, replays {r['replays']}, captures {r['captures']}, threads {r['threads']}",
            flush=True,
        )
        for k in kernels[:8]:
            print(
                f"    {k['ms_per_step']:.3f} ms/step x{k['calls_per_step']:.1f}  {k['name'][:110]}",
                flush=True,
            )
        print(
            f"    host: replay() call {r['launch_ms_median']} ms (median; "
            f"{r['idle_launch_ms_median']} ms the device idle); probe {r['probe_ms']} ms; "
            f"on CPUs {r['cpus']}; {_probe_split(r['steps_and_probes'])}; phases "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms"].items() if v >= 0.05),
            flush=True,
        )
        print(
            f"    unprofiled step median {r['step_ms_unprofiled']} ms; clocks {clocks} -> {r['clocks_after']}",
            flush=True,
        )
        rows.append({"c": c, "policy": policy, **{k: v for k, v in r.items() if not k.startswith("_")}})
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1, default=str)


def _top_kernels(prof: Any, steps: int) -> list[dict[str, Any]]:
    """The profiled window's device work by name, the most time first: ms and calls a step."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if not us:  # a CPU run (--smoke): the operators' own host time
            us = getattr(e, "self_cpu_time_total", 0.0)
        if us > 0:
            rows.append({"name": e.key, "ms_per_step": us / 1e3 / steps, "calls_per_step": e.count / steps})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:25]


def _launch(replay: Any, graph: Any, idle: bool, start: Any) -> tuple[Any, float]:
    """``replay(graph)`` after recording the event ``start``, and its host wall seconds;
    ``idle``: the device synchronized first, so that the launch has no queue ahead of it."""
    if idle:
        import torch

        torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    out = replay(graph)
    return out, time.perf_counter() - t0


def _host_settings(argv: list[str]) -> None:
    """``--gc-off``: no cyclic collection (does the slow mode follow the collector?)."""
    if "--gc-off" in argv:
        gc.collect()
        gc.freeze()
        gc.disable()


def _host_probe_ms(rounds: int = 15) -> float:
    """The median ms of ``rounds`` runs of `probe_seconds`' workload, ten times its default size."""
    return round(statistics.median(probe_seconds(30_000) for _ in range(rounds)) * 1e3, 3)


def _probe_split(pairs: list[tuple[float, float]]) -> str:
    """The step probe's median ms after the slower and the faster half of the steps."""
    if len(pairs) < 4:
        return "no step probes"
    pairs = sorted(pairs)
    half = len(pairs) // 2
    fast, slow = [p for _, p in pairs[:half]], [p for _, p in pairs[half:]]
    return (
        f"probe after the slower half of the steps {_median(slow)} ms "
        f"(steps {pairs[half][0]}-{pairs[-1][0]}), the faster half {_median(fast)} ms"
    )


def _cpu_now() -> int:
    """The CPU this thread last ran on (/proc/thread-self/stat's ``processor``), -1
    where that cannot be read."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _clocks() -> str:
    """The GPU's SM and memory clocks, temperature and power now (nvidia-smi), or why not."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def _unprofiled(values: list[float], scale: float) -> list[float]:
    """``values`` (one a timed step) outside the profiled window, times ``scale``."""
    return [v * scale for i, v in enumerate(values) if not PROFILED[0] <= i < PROFILED[1]]


def _median(values: list[float]) -> float | None:
    """The upper median (a measured value, not a mean of two), None for no values."""
    return statistics.median_high(values) if values else None


if __name__ == "__main__":
    main()
