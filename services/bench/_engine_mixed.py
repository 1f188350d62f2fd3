"""``sluice bench engine --mixed DECODES``: a step that mixes decode rows with one prompt, in
one pass and in two (`engine.runner.ModelRunner.split`), at each count of decode rows.

One pass over a step with a prompt runs the general path's loop over every sequence of the
step; two passes run the decode rows on the decode path (a CUDA graph on a GPU, the eager
vectorised path elsewhere), then the prompt. Both runners, one of them held to one pass,
are timed in turns on the same steps: ``n`` sequences ``--context`` tokens in, each decoding
one token a step, beside a fresh ``--prompt-tokens`` prompt. For scale each round also times
the ``n`` decode rows alone and the prompt alone. Medians over ``--repeats`` rounds, after
one untimed round (a GPU's graph captures)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.runner import ModelRunner, RunnerConfig
from services.bench import Report, progress

MODES = ("one pass", "two passes")


class _Bench:
    """One runner and its sequences: ``n`` decoding, two prompt slots used in turn."""

    def __init__(
        self, model_dir: Path, n: int, context: int, prompt: int, device: str, one_pass: bool
    ) -> None:
        self.n, self.prompt, self.device = n, prompt, device
        self.blocks = -(-(max(context + 64, prompt) + 1) // 256)
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        cfg = RunnerConfig(
            num_blocks=(n + 2) * self.blocks, num_slots=n + 2, device=device, dtype=dtype,
            split_mixed_steps=not one_pass,
        )  # fmt: skip
        self.runner = ModelRunner(model_dir, cfg)
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = self.runner.model_cfg.vocab_size
        self.pos = context
        self.runner.execute(
            ForwardBatch.from_sequences(
                [SequenceInput(self._tokens(context), 0, i, self._table(i)) for i in range(n)], device
            )
        )
        self.turn = 0

    def _tokens(self, k: int) -> list[int]:
        return torch.randint(0, self.vocab, (k,), generator=self.gen).tolist()

    def _table(self, slot: int) -> list[int]:
        return list(range(slot * self.blocks, (slot + 1) * self.blocks))

    def _decodes(self) -> list[SequenceInput]:
        rows = [SequenceInput(self._tokens(1), self.pos, i, self._table(i)) for i in range(self.n)]
        self.pos += 1
        return rows

    def _prompt(self) -> list[SequenceInput]:
        slot = self.n + self.turn % 2  # each prompt starts afresh in the slot not used last
        self.turn += 1
        return [SequenceInput(self._tokens(self.prompt), 0, slot, self._table(slot))]

    def _time(self, rows: list[SequenceInput]) -> float:
        batch = ForwardBatch.from_sequences(rows, self.device)
        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.runner.execute(batch)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def round(self) -> dict[str, float]:
        """One mixed step, then the decode rows alone, then a prompt alone: ms each."""
        return {
            "mixed": self._time(self._decodes() + self._prompt()),
            "decodes": self._time(self._decodes()),
            "prompt": self._time(self._prompt()),
        }


def mixed_report(args: argparse.Namespace, report: Report) -> None:
    model_dir = Path(args.model or "models/trained")
    context = args.context or 256
    counts = [int(x) for x in args.mixed.split(",") if x.strip()]
    report.config.update(
        mixed_decodes=counts, mixed_context=context, device=args.device, model_checkpoint=str(model_dir)
    )
    for n in counts:
        progress(
            f"{n} decodes beside a {args.prompt_tokens}-token prompt: one pass and two, {args.repeats} rounds"
        )
        benches = {
            mode: _Bench(model_dir, n, context, args.prompt_tokens, args.device, mode == MODES[0])
            for mode in MODES
        }
        for bench in benches.values():
            bench.round()  # untimed: kernel selection, graph captures
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, bench in benches.items():  # in turns: a neighbour's load falls on both
                rounds[mode].append(bench.round())
        med = {
            mode: {
                part: statistics.median(r[part] for r in rounds[mode])
                for part in ("mixed", "decodes", "prompt")
            }
            for mode in MODES
        }
        splits = benches[MODES[1]].runner.split_steps
        ratio = med[MODES[1]]["mixed"] / med[MODES[0]]["mixed"]
        report.results[f"decodes_{n}"] = {
            "ms_median": med,
            "rounds": rounds,
            "two_passes_over_one": ratio,
            "split_steps": splits,
        }
        report.rows.append({
            "decodes": n, "prompt tokens": args.prompt_tokens,
            "one pass ms": round(med[MODES[0]]["mixed"], 2), "two passes ms": round(med[MODES[1]]["mixed"], 2),
            "two / one": round(ratio, 3), "decodes alone ms": round(med[MODES[1]]["decodes"], 2),
            "prompt alone ms": round(med[MODES[1]]["prompt"], 2),
        })  # fmt: skip
