"""Is a slow host step the engine's or the machine's? Runs `sluice bench host`'s decode steps
(the forward stubbed, greedy, 128 requests by default) in fresh engines in turn and, after
every timed step, a small fixed pure-Python probe (dict work, L1-resident) in the same
thread. Prints, per engine, its steps slower than ``--slow-ms`` and faster than
``--fast-ms`` with each group's median step and median probe, and over all engines the
correlation of step and probe. A probe that slows with the steps says the thread ran slower,
not that the step did more work: the probe's work never changes.

    PYTHONPATH=$PWD:$PWD/proto .venv/bin/python scripts/host_speed_flips.py
    PYTHONPATH=$PWD:$PWD/proto .venv/bin/python scripts/host_speed_flips.py --engines 4 --phases

With ``--phases`` each group's mean ms in each of `sluice bench host --phases`' phases is
printed too: a machine that runs slower slows every phase alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import services.bench.host as host
from engine.core import EngineCore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/trained")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--engines", type=int, default=10)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--slow-ms", type=float, default=4.2, help="a step at least this long is slow")
    p.add_argument("--fast-ms", type=float, default=3.4, help="a step at most this long is fast")
    p.add_argument("--phases", action="store_true")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)  # the stub's argmax on one thread: no second thread to share the CPU
    rows: list[tuple[float, float, dict[str, float]]] = []  # (step s, probe s, phase s)
    step = EngineCore.step
    timers = host._phase_timers([True], host.PHASES if args.phases else ())
    spent = timers.__enter__()

    def timed_step(self: EngineCore) -> Any:
        before = {k: sum(v) for k, v in spent.items()}
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            wall = time.perf_counter() - t0
            phases = {k: sum(v) - before.get(k, 0.0) for k, v in spent.items()}
            rows.append((wall, host.probe_seconds(), phases))

    EngineCore.step = timed_step  # type: ignore[method-assign]
    every: list[tuple[float, float]] = []
    try:
        for e in range(args.engines):
            rows.clear()
            host._timed_steps(Path(args.model), args.batch, args.steps, 10, None, 0, [False])
            timed = rows[-args.steps :]
            every += [(w, pr) for w, pr, _ in timed]
            slow = [r for r in timed if r[0] * 1e3 >= args.slow_ms]
            fast = [r for r in timed if r[0] * 1e3 <= args.fast_ms]
            print(f"engine {e}: {_group('slow', slow)} | {_group('fast', fast)}", flush=True)
            if args.phases and slow and fast:
                for k in sorted(timed[-1][2]):
                    s, f = (statistics.mean(r[2].get(k, 0.0) for r in g) * 1e3 for g in (slow, fast))
                    if max(s, f) >= 0.05:
                        print(f"    {k}: slow {s:.3f} ms, fast {f:.3f} ms ({s / f:.2f}x)", flush=True)
    finally:
        timers.__exit__(None, None, None)
        EngineCore.step = step  # type: ignore[method-assign]
    a = np.array(every)
    print(f"steps {len(a)}; correlation of step and probe {np.corrcoef(a[:, 0], a[:, 1])[0, 1]:.2f}")


def _group(name: str, g: list[tuple[float, float, dict[str, float]]]) -> str:
    if not g:
        return f"{name} 0"
    step_ms = statistics.median(r[0] for r in g) * 1e3
    probe_ms = statistics.median(r[1] for r in g) * 1e3
    return f"{name} {len(g)} steps, step {step_ms:.2f} ms, probe {probe_ms:.3f} ms"


if __name__ == "__main__":
    main()
