"""Prompts for benchmarks and quality checks: windows of held-out text through a checkpoint's
tokenizer (`heldout_prompts`), seeded random ids (`random_prompts`), the first with the
second as a stated fallback (`text_or_random_prompts`), and lengths staggered over the
model's compression phases (`staggered`, `phase_period`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch


def heldout_prompts(model_dir: str | Path, n: int, length: int, phase: float = 0.0) -> list[list[int]]:
    """``n`` prompts of ``length`` ids from the held-out split of this interpreter's stdlib.

    The stream is built as ``sluice train data`` builds ``heldout.bin``: each held-out file's ids
    (the checkpoint's ``tokenizer.json``, no special tokens) followed by EOS, files in manifest
    (sorted path) order. Prompt ``k`` is ``[BOS] + stream[s_k : s_k + length - 1]`` with
    ``s_k = min(floor((k + phase) * m / (n - 1)), m - 1)``, ``m = len(stream) - length + 1``:
    starts evenly spread over the whole stream (windows overlap once ``n * length`` exceeds it).
    ``phase`` in [0, 1) moves every start by that share of the spacing: another sample of the
    same text, as evenly spread."""
    import json

    from tokenizers import Tokenizer

    from engine.train.corpus import load_corpus, split

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    bos, eos = int(config["bos_token_id"]), int(config["eos_token_id"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = load_corpus()
    stream: list[int] = []
    for i in split(corpus.manifest).heldout:
        stream.extend(tok.encode(corpus.texts[i], add_special_tokens=False).ids)
        stream.append(eos)
    span = len(stream) - (length - 1)
    if n < 1 or span < 1:
        raise ValueError(f"the held-out stream has {len(stream)} ids: too short for {n} prompts of {length}")
    if not 0.0 <= phase < 1.0:
        raise ValueError(f"phase must be in [0, 1), got {phase}")
    shift = round(phase * span)
    starts = [shift] if n == 1 else [(k * span + shift) // (n - 1) for k in range(n)]
    return [[bos, *stream[s : s + length - 1]] for s in [min(s, span - 1) for s in starts]]


def text_or_random_prompts(
    model_dir: str | Path, n: int, length: int, seed: int = 0, source: str = "auto"
) -> tuple[list[list[int]], str]:
    """``n`` prompts of ``length`` ids and where they came from. ``source``: ``"heldout"``
    (`heldout_prompts`, or ValueError), ``"random"`` (`random_prompts`), or ``"auto"``: held-out
    text when the checkpoint's tokenizer and the corpus allow it and its ids fit the model's
    vocabulary, else random ids (the label says why)."""
    import json

    vocab = int(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    reason = ""
    if source != "random":
        try:
            prompts = heldout_prompts(model_dir, n, length)
            if max(max(p) for p in prompts) >= vocab:
                raise ValueError(f"its tokenizer's ids exceed the model's vocabulary of {vocab}")
            return prompts, "heldout-v1 windows"
        except Exception as exc:  # noqa: BLE001 - no tokenizer (tokenizers raises a bare Exception), no corpus
            if source == "heldout":
                raise ValueError(f"held-out prompts: {type(exc).__name__}: {exc}") from exc
            reason = f" ({type(exc).__name__}: {exc})"
    return random_prompts(vocab, n, length, seed), f"random tokens{reason}"


def staggered(prompts: Sequence[Sequence[int]], period: int) -> list[list[int]]:
    """Prompt ``k`` shortened by ``k mod period`` ids, so that a batch's positions are spread
    over ``period`` phases, as independent requests' are.

    Prompts of one length decode in lockstep: every compressor window closes in the same step
    for every request (one pooling call a layer), a phase that speculation breaks as soon as
    requests accept different numbers of drafts. Comparing plain decoding in lockstep with
    speculation out of it priced the phase, not the policy (the CPU's DSpark with speculation
    off ran 4-7 % below plain decoding at 16 requests: docs/benchmarks.md). ``period``: the
    least common multiple of the model's compression rates (`phase_period`)."""
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    out = [list(p[: max(len(p) - k % period, 0)]) for k, p in enumerate(prompts)]
    if any(not p for p in out):
        raise ValueError(
            f"prompts of {min(len(p) for p in prompts)} ids are too short to stagger over {period} phases"
        )
    return out


def phase_period(model_dir: str | Path) -> int:
    """The least common multiple of the compression rates of the checkpoint in ``model_dir``
    (`staggered`'s period: 128 for V4's rates of 4 and 128)."""
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return math.lcm(cfg.csa_rate, cfg.hca_rate)


def random_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` ids uniform over ``[3, vocab_size)`` (past BOS, EOS, pad), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n, length), generator=g).tolist()
