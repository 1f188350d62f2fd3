"""``sluice bench <area>``: run a benchmark area and print a table or one JSON object."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from services import bench


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark area (table, or JSON with --json)")
    areas = p.add_subparsers(dest="area", metavar="AREA")
    areas.required = True
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{bench.__name__}.{info.name}")
        ap = areas.add_parser(info.name, help=(module.__doc__ or "").strip().splitlines()[0])
        ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        module.add_arguments(ap)
        ap.set_defaults(func=_runner(module))


def _runner(module):
    def run(args: argparse.Namespace) -> int:
        report = module.run(args)
        bench.emit(report, args.json)
        return 0

    return run
