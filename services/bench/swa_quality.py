"""Bounded SWA replay quality: greedy agreement and KL of W-1-token replay against exact state.

For each model (default: the shipped ``trained`` preset and the random ``small`` preset) and
each prompt of ``H + S`` tokens (``H`` the hit, a multiple of the 256-token block, by default
the smallest one above ``L * (W - 1)``; ``S`` the new turn), `engine.replay_quality.measure`
decodes ``D`` tokens greedily from exact state, then rebuilds a fresh slot over the hit's
shared blocks by replaying only the last ``W - 1`` hit tokens, prefills the suffix and
teacher-forces the exact path's tokens. Reported per model: mean and p10 of the per-prompt
greedy (top-1) agreement over the ``D`` positions, mean per-token KL(exact || bounded) in
nats, the exact-replay control (``L * (W - 1)`` tokens replayed: agreement must be 1 and KL
~0), the mean length of the bounded path's own greedy decode before it first leaves the exact
one, and the wall time.

Host-slot variants (``--slot-variants``), each measured the same way from the exact slot at
``H`` stored as a host slot pool stores it (`engine.replay_quality.SlotVariant`): ``mxfp8``
(every layer, no replay: MXFP8 against the native dtype's exact state) and ``native:K`` /
``mxfp8:K`` (the first K layers kept, the others rebuilt by the bounded replay). By default:
``mxfp8``, ``native:K`` for every K from 1 to L - 1, and ``mxfp8:K`` at V4.1-Flash's share of
kept layers (20 of 43, rounded).

Prompts: for a checkpoint whose ``config.json`` names the ``trained`` preset, windows of the
held-out split of this interpreter's stdlib (`engine.prompts.heldout_prompts`: starts
evenly spread over the held-out token stream); for any other (random) checkpoint, seeded
uniform random ids (`engine.prompts.random_prompts`). fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.bench import Report, progress

TARGET_AGREEMENT = 0.90
DEFAULT_PRESETS = ("trained", "small")
FLASH_KEPT, FLASH_LAYERS = 20, 43  # V4.1-Flash keeps the first 20 of its 43 layers' windows


def default_variants(layers: int) -> list[str]:
    share = max(1, round(layers * FLASH_KEPT / FLASH_LAYERS))
    return ["mxfp8", *(f"native:{k}" for k in range(1, layers)), f"mxfp8:{share}"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", action="append", default=None, metavar="DIR",
        help="checkpoint directory (repeatable; default: the trained and small presets)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=200, help="prompts per model (default 200)")
    p.add_argument("--hit", type=int, default=None, help="hit H in tokens (default: smallest 256k > L*(W-1))")
    p.add_argument(
        "--suffix", type=int, default=64, help="suffix S: prompt tokens after the hit (default 64)"
    )
    p.add_argument("--decode", type=int, default=64, help="decoded tokens D (default 64)")
    p.add_argument("--batch", type=int, default=16, help="prompts per forward (default 16)")
    p.add_argument("--no-free-run", action="store_true", help="skip the bounded path's own greedy decode")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default 0: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the slot noise")
    p.add_argument(
        "--slot-variants", default=None, metavar="LIST",
        help="host-slot forms to measure, comma-separated native|mxfp8[:LAYERS] ('' for none; "
        "default: mxfp8, native:K for K < L, mxfp8 at 20/43 of the layers)",
    )  # fmt: skip


def _model_dirs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    if args.model:
        return [(Path(m).name, Path(m)) for m in args.model]
    from engine.checkpoint.presets import resolve_preset
    from services import envs

    return [(name, resolve_preset(name, envs.HOME.get())) for name in DEFAULT_PRESETS]


def _is_trained(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return config.get("sluice", {}).get("preset") == "trained"


def _measure(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import ModelConfig
    from engine.prompts import heldout_prompts, random_prompts
    from engine.replay_quality import SlotVariant, default_hit, measure

    cfg = ModelConfig.from_dir(model_dir)
    hit = args.hit if args.hit is not None else default_hit(cfg.num_hidden_layers, cfg.sliding_window)
    length = hit + args.suffix
    trained = _is_trained(model_dir)
    if trained:
        prompts = heldout_prompts(model_dir, args.prompts, length)
        source = "held-out stdlib windows (heldout-v1)"
    else:
        prompts = random_prompts(cfg.vocab_size, args.prompts, length, args.seed)
        source = f"uniform random ids (seed {args.seed})"
    names = (
        default_variants(cfg.num_hidden_layers)
        if args.slot_variants is None
        else args.slot_variants.split(",")
    )
    variants = [SlotVariant.parse(v) for v in names if v]
    progress(f"{name}: {len(prompts)} prompts of {hit}+{args.suffix} tokens, decode {args.decode}")

    def tick(done: int, total: int) -> None:
        progress(f"{name}: {done}/{total} prompts")

    q = measure(
        model_dir, prompts, hit, args.decode, batch=args.batch, free_run=not args.no_free_run,
        progress=tick, seed=args.seed, variants=variants,
    )  # fmt: skip
    return {
        "model": name, "dir": str(model_dir), "trained": trained, "prompt_source": source,
        **q.summary(), "per_prompt_agreement": [p.agreement for p in q.prompts],
        "per_prompt_kl": [p.kl for p in q.prompts],
    }  # fmt: skip


def run(args: argparse.Namespace) -> Report:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts < 1 or args.suffix < 1 or args.decode < 1:
        raise ValueError("--prompts, --suffix and --decode must be >= 1")
    report = Report(
        "swa_quality",
        config={
            "prompts": args.prompts, "hit": args.hit, "suffix": args.suffix, "decode": args.decode,
            "batch": args.batch, "free_run": not args.no_free_run, "seed": args.seed,
            "dtype": "float32", "device": "cpu", "torch_threads": torch.get_num_threads(),
        },
    )  # fmt: skip
    results = []
    for name, model_dir in _model_dirs(args):
        r = _measure(name, model_dir, args)
        results.append(r)
        report.rows.append(
            {
                "model": name, "prompts": r["prompts"], "H": r["hit"], "S": r["suffix"], "D": r["decode"],
                "replay": r["replay"], "agree": r["mean_agreement"], "p10": r["p10_agreement"],
                "KL": r["mean_kl"], "ctl_agree": r["control_agreement"], "ctl_KL": r["control_kl"],
                "free_run": r["mean_free_run"] if r["mean_free_run"] is not None else "",
                "wall_s": round(r["wall_s"], 1),
            }
        )  # fmt: skip
        for v in r["variants"]:
            report.rows.append(
                {
                    "model": f"{name} {v['variant']}", "prompts": r["prompts"], "H": r["hit"],
                    "S": r["suffix"], "D": r["decode"], "agree": v["mean_agreement"],
                    "p10": v["p10_agreement"], "KL": v["mean_kl"],
                }
            )  # fmt: skip
    report.results = {"models": results}
    trained = [r for r in results if r["trained"]]
    if trained:
        report.target(
            "bounded replay greedy agreement (trained)", trained[0]["mean_agreement"], ">=", TARGET_AGREEMENT
        )
    return report
