"""The drafting tests' setting: the trained preset's runner with three sequences prefilled,
and a decode step of all three that hands each a drafting run (CPU here; CUDA in tests/gpu)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.confidence import ConfidenceHead
from engine.runner import ModelRunner, RunnerConfig
from engine.spec.drafter import Drafter, DraftRun

MODEL = "models/trained"
PROMPTS = (40, 25, 60)


def prefilled(
    mode: str, seed: int, head: ConfidenceHead | None = None, **runner: Any
) -> tuple[ModelRunner, Drafter, list[list[int]]]:
    """A runner (decode graphs ``mode``; ``runner``: more `RunnerConfig` fields) and its drafter
    with ``head``, and three seeded sequences of `PROMPTS` tokens and 8 more, each prefilled
    into its own slot and block."""
    r = ModelRunner(MODEL, RunnerConfig(num_blocks=4, num_slots=4, decode_graphs=mode, **runner))
    drafter = Drafter(r.model, r.pool, r.swa, head, r.graphs)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, r.model_cfg.vocab_size, (n + 8,), generator=gen).tolist() for n in PROMPTS]
    rows = [SequenceInput(s[:n], 0, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
    r.execute(ForwardBatch.from_sequences(rows, device=r.cfg.device))
    return r, drafter, seqs


def decode_step(
    runner: ModelRunner, seqs: list[list[int]], step: int, wanted: Sequence[int]
) -> tuple[torch.Tensor, list[DraftRun]]:
    """Decode step ``step`` (0 first) of every sequence -> its hidden streams, and each
    sequence's drafting run wanting ``wanted[i]`` drafts (0: only the MTP window's writes)."""
    dev = runner.cfg.device
    rows = [SequenceInput([s[n + step]], n + step, i, [i]) for i, (s, n) in enumerate(zip(seqs, PROMPTS))]
    out = runner.execute(ForwardBatch.from_sequences(rows, device=dev))
    runs = [
        DraftRun(str(i), i, [i], n + step, [s[n + step + 1]], i, 0, d)
        for i, (s, n, d) in enumerate(zip(seqs, PROMPTS, wanted))
    ]
    return out.hidden, runs
