"""``sluice record-expert-loads``: greedy-decode prompts on one engine rank and dump the
per-step, per-layer tokens routed to each logical expert (the ``.npz`` that
``sluice bench eplb --loads`` reads). Prompts: windows of the held-out split of the training
corpus when the checkpoint has a tokenizer and the corpus is at hand (a trained model then
routes real text), else seeded random tokens; the summary says which."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "record-expert-loads", help="greedy generation on one rank; dump per-step expert loads (.npz)"
    )
    p.add_argument(
        "--model", type=Path, required=True, help="checkpoint directory (e.g. sluice gen-checkpoint)"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="output .npz (counts [steps, moe_layers, experts])"
    )
    p.add_argument("--seqs", type=int, default=16, help="sequences decoded together (tokens per decode step)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per sequence (= engine steps)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--prompts",
        choices=("auto", "heldout", "random"),
        default="auto",
        help="held-out text windows (auto: when the checkpoint's tokenizer and the corpus allow), or random tokens",
    )
    p.add_argument("--dtype", default="float32")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.eplb import ExpertLoadRecorder
    from engine.runner import ModelRunner, RunnerConfig
    from services.eplb.engine import blocks_needed, greedy_generate

    if args.seqs < 1 or args.prompt_len < 1 or args.tokens < 1:
        raise ValueError("--seqs, --prompt-len and --tokens must be >= 1")
    prompts, source = _prompts(args)
    blocks = args.seqs * blocks_needed(args.prompt_len + args.tokens)
    cfg = RunnerConfig(num_blocks=blocks, num_slots=args.seqs, dtype=args.dtype, with_mtp=False)
    runner = ModelRunner(args.model, cfg)
    moes = runner.model.moe_layers()
    recorder = ExpertLoadRecorder(len(moes), moes[0].placement.num_logical, window=1, keep_history=True)

    def on_step(step: int, _logits: object) -> None:
        for layer, moe in enumerate(moes):
            recorder.record_counts(layer, moe.last_load)
        recorder.end_step()

    t0 = time.perf_counter()
    greedy_generate(runner, prompts, args.tokens, on_step)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    recorder.dump(str(args.out))
    counts = recorder.history()
    summary = {
        "out": str(args.out),
        "prompts": source,
        "shape": list(counts.shape),
        "seconds": round(time.perf_counter() - t0, 1),
        "decode_step_hottest_over_mean": round(
            float((counts[1:].max(-1) / counts[1:].mean(-1)).mean()) if len(counts) > 1 else 0.0, 3
        ),
    }
    json.dump(summary, sys.stdout)
    print()
    return 0


def _prompts(args: argparse.Namespace) -> tuple[list[list[int]], str]:
    """The prompts and where they came from (``--prompts``)."""
    from engine.prompts import text_or_random_prompts

    return text_or_random_prompts(args.model, args.seqs, args.prompt_len, args.seed, args.prompts)
