"""Time a step that mixes decode rows with one prompt, in one pass and in two
(`ModelRunner.split`), on the trained preset.

    .venv/bin/python scripts/mixed_step.py --decodes 31 --prompt 245 --steps 6

Prints each step's milliseconds per mode and a decode-only step for scale. On a GPU pass
``--device cuda`` (bf16; decode rows run as graphs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig


def _time(runner: ModelRunner, batch: ForwardBatch, device: str) -> float:
    start = time.perf_counter()
    runner.execute(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def _tokens(gen: torch.Generator, vocab: int, k: int) -> list[int]:
    return torch.randint(0, vocab, (k,), generator=gen).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/trained")
    ap.add_argument("--decodes", type=int, default=31, help="decode rows beside the prompt")
    ap.add_argument("--context", type=int, default=200, help="tokens each decode row already has")
    ap.add_argument("--prompt", type=int, default=245, help="the prompt's tokens")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, dev = args.decodes, args.device
    blocks = -(-(max(args.context + args.steps, args.prompt) + 1) // 256)
    dtype = "bfloat16" if dev == "cuda" else "float32"
    for mode in ("one pass", "two passes"):
        cfg = RunnerConfig(num_blocks=(n + 2) * blocks, num_slots=n + 2, device=dev, dtype=dtype)
        runner = ModelRunner(args.model, cfg)
        if mode == "one pass":
            runner.split = lambda batch: None  # type: ignore[method-assign]
        table = [list(range(i * blocks, (i + 1) * blocks)) for i in range(n + 2)]
        gen = torch.Generator().manual_seed(0)
        vocab = runner.model_cfg.vocab_size

        runner.execute(
            ForwardBatch.from_sequences(
                [SequenceInput(_tokens(gen, vocab, args.context), 0, i, table[i]) for i in range(n)], dev
            )
        )
        mixed = []
        for t in range(args.steps):
            rows = [SequenceInput([5], args.context + t, i, table[i]) for i in range(n)]
            slot = n + t % 2  # two slots in turn: each step's prompt starts afresh
            rows.append(SequenceInput(_tokens(gen, vocab, args.prompt), 0, slot, table[slot]))
            mixed.append(_time(runner, ForwardBatch.from_sequences(rows, dev), dev))
        rows = [SequenceInput([5], args.context + args.steps, i, table[i]) for i in range(n)]
        decode = _time(runner, ForwardBatch.from_sequences(rows, dev), dev)
        print(
            f"{mode}: mixed steps {[round(x, 1) for x in mixed]} ms (median {statistics.median(mixed):.1f}), "
            f"a decode-only step {decode:.1f} ms, split steps {runner.split_steps}"
        )


if __name__ == "__main__":
    main()
