"""Benchmark harness shared by every ``sluice bench <area>``.

An area is a module ``services/bench/<area>.py`` with ``add_arguments(parser)`` and
``run(args) -> Report``. The output contract (docs/development.md, benchmarks): one JSON object with ``bench``, ``machine``, ``config``, ``results`` and
``targets`` (each ``{"name", "value", "op", "target", "met"}``), or a table for people.
Targets are computed in the run that reports them; an unmet target stays in the list.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    op: str
    target: float
    # what a reader of the verdict must know (a comparison that grades something other
    # than its name says, say); in the JSON only when set
    note: str | None = None

    @property
    def met(self) -> bool:
        return bool(_OPS[self.op](self.value, self.target))

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self), "met": self.met}
        if self.note is None:
            del out["note"]
        return out


@dataclass
class Report:
    bench: str
    config: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # the human table; in the JSON as "rows"

    def target(self, name: str, value: float, op: str, target: float, note: str | None = None) -> Target:
        if op not in _OPS:
            raise ValueError(f"unknown comparison {op!r}; use one of {sorted(_OPS)}")
        t = Target(name, float(value), op, float(target), note)
        self.targets.append(t)
        return t

    def to_json(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "machine": machine_info(),
            "config": self.config,
            "results": self.results,
            "targets": [t.to_json() for t in self.targets],
            "rows": self.rows,
        }


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0]}
    libs = {}
    for dist in ("torch", "numpy", "pyeclib", "zfec", "redis", "grpcio", "ray", "transformers"):
        try:
            libs[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    info["libs"] = libs
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def render_table(report: Report) -> str:
    lines = [f"== sluice bench {report.bench} =="]
    if report.rows:
        cols = list(dict.fromkeys(k for row in report.rows for k in row))
        widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in report.rows)) for c in cols}
        lines.append("  ".join(c.ljust(widths[c]) for c in cols))
        for row in report.rows:
            lines.append("  ".join(_fmt(row.get(c, "")).ljust(widths[c]) for c in cols))
    if report.targets:
        lines.append("")
        lines.append("targets:")
        for t in report.targets:
            mark = "met" if t.met else "NOT MET"
            lines.append(f"  {t.name}: {_fmt(t.value)} {t.op} {_fmt(t.target)}  [{mark}]")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def emit(report: Report, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=False))
    else:
        print(render_table(report))


def module_main(
    area: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], Report],
    argv: Sequence[str] | None = None,
) -> None:
    """``python -m services.bench.<area>``: the same as ``sluice bench <area>``, for hosts that
    lack the CLI's service dependencies (the GPU machine)."""
    p = argparse.ArgumentParser(prog=f"sluice bench {area}")
    add_arguments(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    emit(run(args), args.json)


def progress(message: str) -> None:
    """Progress for long runs goes to stderr so --json stdout stays one object."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cuda_mean_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Mean ms of ``fn()`` over ``repeats`` back-to-back launches after one warm-up, by CUDA
    events (the kernel benches: `sluice bench moe`, `sluice bench attention`)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats
