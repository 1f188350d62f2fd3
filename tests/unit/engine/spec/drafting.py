"""The drafting tests' setting: the trained preset's runner with sequences prefilled (three by
default), and a decode or verification-shaped step of all of them that hands each a drafting
run (CPU here; CUDA in tests/gpu)."""

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
    mode: str,
    seed: int,
    head: ConfidenceHead | None = None,
    prompts: Sequence[int] = PROMPTS,
    **runner: Any,
) -> tuple[ModelRunner, Drafter, list[list[int]]]:
    """A runner (decode graphs ``mode``; ``runner``: more `RunnerConfig` fields) and its drafter
    with ``head``, and seeded sequences of ``prompts`` tokens and 8 more, each prefilled into
    its own slot and block."""
    slots = max(4, len(prompts) + 1)
    r = ModelRunner(MODEL, RunnerConfig(num_blocks=slots, num_slots=slots, decode_graphs=mode, **runner))
    drafter = Drafter(r.model, r.pool, r.swa, head, r.graphs)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, r.model_cfg.vocab_size, (n + 8,), generator=gen).tolist() for n in prompts]
    rows = [SequenceInput(s[:n], 0, i, [i]) for i, (s, n) in enumerate(zip(seqs, prompts))]
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


def verify_step(
    runner: ModelRunner,
    seqs: list[list[int]],
    tokens: Sequence[int],
    wanted: Sequence[int],
    done: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[DraftRun]]:
    """A step in which sequence ``i`` (`prefilled`) brings ``tokens[i]`` of its 8 tokens past
    the prompt, after the ``done[i]`` run already (default none), as a verification step brings
    the input token and the drafts it accepted -> the hidden streams, and each sequence's
    drafting run over those positions wanting ``wanted[i]`` drafts."""
    dev = runner.cfg.device
    starts = [len(s) - 8 + (0 if done is None else done[i]) for i, s in enumerate(seqs)]
    rows = [SequenceInput(s[n : n + k], n, i, [i]) for i, (s, n, k) in enumerate(zip(seqs, starts, tokens))]
    out = runner.execute(ForwardBatch.from_sequences(rows, device=dev))
    flat = [sum(tokens[:i]) for i in range(len(tokens))]
    runs = [
        DraftRun(str(i), i, [i], n, s[n + 1 : n + k + 1], f, 0, d)
        for i, (s, n, k, f, d) in enumerate(zip(seqs, starts, tokens, flat, wanted))
    ]
    return out.hidden, runs
