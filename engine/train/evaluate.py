"""Held-out measures of a trained model: perplexity and the MTP layer's draft acceptance.

**Perplexity** is scored per token over a token stream with the baselines' convention (every
id, each file's closing EOS included). The stream is cut into windows of ``seq_len`` tokens
that advance by half a window; each window is fed as ``[BOS] + tokens`` and scores only the
tokens no earlier window scored, so every token is scored exactly once with at least half a
window of context (the first window's tokens with whatever precedes them).

**Draft acceptance** (top-1 agreement with the target) at draft positions 1-5, measured the
way speculation consumes it. From ``n_prompts`` held-out prefixes the target continues
greedily for ``gen_tokens`` tokens (the chain ``c``: by construction the target's own top-1
at every position). The single MTP layer then drafts along the chain: pass 1 takes the
target's streams at position ``q`` and the embedding of ``c[q+1]`` and predicts ``c[q+2]``;
pass ``j`` takes pass ``j-1``'s output streams at ``q-1`` and the embedding of ``c[q+1]``
(the previous draft, when it was accepted). From an anchor ``t`` inside the generated
region, draft ``j`` is pass ``j`` at ``q = t + j - 1`` and is accepted when it equals
``c[t + j + 1]``. Reported per position: the rate given every earlier draft was accepted
(what speculation sees), and the unconditional rate. Each pass attends over its own earlier
positions; in an engine the earlier positions of a reused MTP layer hold pass-1 entries, so
positions 2-5 here are a close, stated approximation; position 1 is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.train.model import TrainModel


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored) spans of the stream covering every token exactly once."""
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    stride = seq_len // 2
    out = []
    start = 0
    scored = 0
    while scored < n_tokens:
        end = min(start + seq_len, n_tokens)
        out.append((start, end, scored))
        scored = end
        start += stride
    return out


@torch.no_grad()
def score_stream(
    model: TrainModel,
    stream: np.ndarray,
    seq_len: int,
    bos: int,
    device: torch.device,
    micro_batch: int = 4,
    max_windows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Mean negative log-likelihood (nats/token) and perplexity of ``stream``."""
    was_training = model.training
    model.eval()
    model.indexer.enabled = False
    spans = windows(len(stream), seq_len)
    if max_windows is not None:
        spans = spans[:max_windows]
    total, count = 0.0, 0
    try:
        for i in range(0, len(spans), micro_batch):
            group = spans[i : i + micro_batch]
            width = max(end - start for start, end, _ in group)
            ids = torch.full((len(group), width), bos, dtype=torch.long)
            for r, (start, end, _) in enumerate(group):
                ids[r, 1 : end - start] = torch.from_numpy(stream[start : end - 1].astype(np.int64))
            ids = ids.to(device)
            streams, _ = model.trunk(ids)
            logp = model.main_logits(streams).float().log_softmax(dim=-1)
            for r, (start, end, first) in enumerate(group):
                target = torch.from_numpy(stream[start:end].astype(np.int64)).to(device)
                lp = logp[r, : end - start].gather(1, target.unsqueeze(1)).squeeze(1)
                lp = lp[first - start :]
                total -= float(lp.double().sum())
                count += int(lp.numel())
            if progress is not None:
                progress(min(i + micro_batch, len(spans)), len(spans))
    finally:
        model.indexer.enabled = True
        model.train(was_training)
    nll = total / max(count, 1)
    return {"nll": nll, "ppl": float(np.exp(nll)), "tokens": count}


def prompt_offsets(n_tokens: int, n_prompts: int, prompt_len: int) -> list[int]:
    """Evenly spaced starts of ``n_prompts`` prefixes of ``prompt_len`` tokens."""
    span = n_tokens - prompt_len - 1
    if span <= 0:
        raise ValueError("the stream is shorter than one prompt")
    n = min(n_prompts, span)
    return [int(i * span / n) for i in range(n)]


@torch.no_grad()
def greedy_chains(model: TrainModel, prompts: torch.Tensor, gen_tokens: int) -> torch.Tensor:
    """Greedy continuation by full recomputation: prompts [P, L] -> [P, L + gen_tokens]."""
    ids = prompts
    for _ in range(gen_tokens):
        streams, _ = model.trunk(ids)
        nxt = model.main_logits(streams[:, -1:]).float().argmax(dim=-1)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@torch.no_grad()
def mtp_acceptance(
    model: TrainModel,
    stream: np.ndarray,
    bos: int,
    device: torch.device,
    n_prompts: int = 64,
    prompt_len: int = 256,
    gen_tokens: int = 32,
    depth: int = 5,
    micro_batch: int = 16,
) -> dict[str, Any]:
    """Draft acceptance at positions 1..depth on greedy chains from held-out prefixes."""
    was_training = model.training
    model.eval()
    model.indexer.enabled = False
    starts = prompt_offsets(len(stream), n_prompts, prompt_len - 1)
    hits = np.zeros(depth)
    runs = np.zeros(depth)  # anchors whose drafts 1..j-1 all agreed
    uncond = np.zeros(depth)
    anchors = 0
    try:
        for i in range(0, len(starts), micro_batch):
            group = starts[i : i + micro_batch]
            rows = [[bos, *stream[s : s + prompt_len - 1].astype(np.int64).tolist()] for s in group]
            chain = greedy_chains(model, torch.tensor(rows, device=device), gen_tokens)
            streams, kwargs = model.trunk(chain)
            n = chain.shape[1]
            agree = []
            nxt = torch.cat([chain[:, 1:], chain[:, -1:]], dim=1)  # the token after each position
            t = torch.arange(prompt_len - 1, n - depth - 1, device=device)  # anchors: t + depth + 1 < n
            for j, hidden in enumerate(model.draft_passes(streams, nxt, kwargs, depth), start=1):
                draft = model.mtp_logits(hidden).float().argmax(dim=-1)  # at q: predicts chain[q + 2]
                q = t + j - 1
                agree.append((draft[:, q] == chain[:, t + j + 1]).cpu().numpy())
            all_prev = np.ones_like(agree[0], dtype=bool)
            for j in range(depth):
                runs[j] += all_prev.sum()
                hits[j] += (agree[j] & all_prev).sum()
                all_prev = all_prev & agree[j]
                uncond[j] += agree[j].sum()
            anchors += agree[0].size
    finally:
        model.indexer.enabled = True
        model.train(was_training)
    conditional = [float(h / r) if r else 0.0 for h, r in zip(hits, runs, strict=True)]
    # expected accepted drafts per step when all `depth` drafts are verified
    accepted = float(sum(np.prod(conditional[: j + 1]) for j in range(depth)))
    return {
        "positions": list(range(1, depth + 1)),
        "conditional": conditional,
        "unconditional": [float(u / anchors) for u in uncond],
        "expected_accepted": accepted,
        "anchors": anchors,
        "n_prompts": len(starts),
        "prompt_len": prompt_len,
        "gen_tokens": gen_tokens,
    }
