"""``sluice gen-checkpoint``: write a random DeepSeek-V4 checkpoint (tests, demos, GPU benchmarks)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _random_preset(name: str) -> str:
    """A random preset's name; a shipped one (trained weights) is a usage error saying so."""
    from engine.checkpoint.presets import SHIPPED

    if name in SHIPPED:
        raise argparse.ArgumentTypeError(
            f"{name!r} is a shipped preset (trained weights in {SHIPPED[name]}), not generated; "
            f"serve it with `sluice serve --preset {name}`"
        )
    return name


def register(sub: argparse._SubParsersAction) -> None:
    from engine.checkpoint.presets import PRESETS

    p = sub.add_parser("gen-checkpoint", help="write a random DeepSeek-V4 checkpoint in the HF layout")
    p.add_argument(
        "--preset",
        type=_random_preset,
        choices=sorted(PRESETS),
        default="tiny",
        help="random preset (the shipped trained one is not generated)",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument(
        "--quant",
        choices=["fp8", "fp4"],
        default=None,
        help="store DeepSeek's released formats: fp8 = FP8 block-scaled linears, fp4 = that plus FP4 experts",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a config field, e.g. --set index_topk=4 (value parsed as JSON)",
    )
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.layers is not None:
        if args.layers < 1:
            raise ValueError("--layers must be at least 1")
        out["num_hidden_layers"] = args.layers
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=JSON, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw  # a bare string such as --set dtype=bfloat16
    return out


def run(args: argparse.Namespace) -> int:
    from engine.checkpoint.generate import generate_checkpoint

    result = generate_checkpoint(args.preset, args.out, seed=args.seed, quant=args.quant, **_overrides(args))
    print(
        f"wrote {args.preset} checkpoint to {result.path}: "
        f"{result.num_parameters:,} parameters, {result.num_bytes / 2**20:.1f} MiB in {len(result.files)} file(s)"
    )
    return 0
