"""Deterministic, batch-invariant sampling (torch, fp32, on the logits' device).

No operation mixes rows, so a row's result cannot depend on which other requests share the
batch. Randomness is one number per token, ``uniform(derive(request seed, output index))``:
the k-th token of a seeded request sees the same number alone, in any batch, under any
chunking, in synchronous or asynchronous mode, with or without speculation. The draw is the
inverse CDF (the first token whose cumulative probability exceeds that number), an exact
draw from ``p``; greedy is ``argmax`` with the lowest token id on ties. Rows with neither a
grammar nor penalties are drawn together (`sample_rows`, one pass over ``[R, V]`` on the
device); a row with either goes through `sample_row`, which runs the same code on one row.

Order per row: grammar mask -> repetition/presence/frequency penalties -> temperature ->
top-k -> top-p -> min-p -> draw. Logprobs are those of the model's raw distribution
(log_softmax of the unprocessed logits), as vLLM v1 returns by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.forward_batch import upload
from engine.sampling.params import SamplingParams, derive_seed


@dataclass(frozen=True)
class RowInput:
    """One sampled row: its params, seed, position among outputs and token history."""

    params: SamplingParams
    seed: int
    output_index: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    allowed_mask: torch.Tensor | None = None  # [V] bool, from the grammar; None: all allowed


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely under the raw distribution
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first, ties by lower id


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


def _apply_penalties(logits: torch.Tensor, row: RowInput) -> torch.Tensor:
    p = row.params
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = [t for t in (*row.prompt_token_ids, *row.output_token_ids) if t < vocab]
        if ids:
            seen[torch.tensor(ids, dtype=torch.long)] = True
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.output_token_ids:
        counts = torch.bincount(torch.tensor(list(row.output_token_ids), dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(torch.float32)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(torch.float32)
    return logits


def _truncate_rows(
    logits: torch.Tensor,  # [R, V] temperature-scaled
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
) -> torch.Tensor:
    """Top-k, top-p and min-p, each row with its own settings; removed tokens get -inf. A
    setting that is off leaves its row untouched (not even a rounding-level mask)."""
    r, v = logits.shape
    dev = logits.device
    neg_inf = logits.new_full((), float("-inf"))
    if any(0 < k < v for k in top_k):
        k = upload(torch.tensor([k if 0 < k < v else v for k in top_k]), dev)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = torch.where(logits >= kth, logits, neg_inf)
    if any(p < 1.0 for p in top_p):
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        probs = torch.softmax(logits.gather(1, order), dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        limit = upload(torch.tensor(top_p, dtype=logits.dtype), dev)[:, None]
        on = upload(torch.tensor([p < 1.0 for p in top_p]), dev)[:, None]
        drop_sorted = ((cum - probs) >= limit) & on  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = (
            upload(torch.tensor(min_p, dtype=logits.dtype), dev)[:, None] * probs.max(-1, keepdim=True).values
        )
        logits = torch.where(probs >= floor, logits, neg_inf)
    return logits


def uniform(seed: int) -> float:
    """The draw's one random number in [0, 1) for a derived seed (63 uniform bits)."""
    return (seed >> 10) / float(1 << 53)


def _draw_rows(logits: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """Inverse-CDF draws, one per row of ``logits`` ``[R, V]``: the first token whose
    cumulative probability exceeds ``uniform(seed)`` of the total, an exact draw from the
    row's softmax. Zero-probability tokens never are (their cumulative sum does not rise)."""
    probs = torch.softmax(logits, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    u = upload(torch.tensor([uniform(s) for s in seeds], dtype=cum.dtype), cum.device)[:, None]
    target = u * cum[:, -1:]
    tokens = torch.searchsorted(cum, target, right=True).squeeze(1)
    # a u that rounds the target up to the total lands past the end: the last possible token
    ids = torch.arange(logits.shape[1], device=logits.device)
    last = torch.where(probs > 0, ids, -1).max(dim=-1).values
    return torch.minimum(tokens, last)


def draw_seed(seed: int, output_index: int) -> int:
    """The derived seed of a request's ``output_index``-th token."""
    return derive_seed(seed, f"tok:{output_index}")


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> list[int]:
    """Tokens of rows ``logits [R, V]`` (any device and float dtype; computed in fp32), row i
    with ``params[i]`` (temperature > 0, no penalties) and the derived seed ``seeds[i]``
    (`draw_seed`). Every operation is row by row: a row's token does not depend on the
    others. `sample_row` runs the same code on one row."""
    return draw_rows(logits, params, seeds).tolist()


def draw_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> torch.Tensor:
    """`sample_rows`' tokens [R] (int64) left on the logits' device: queued there without
    waiting for it (every host value goes up through `upload`)."""
    temps = upload(torch.tensor([p.temperature for p in params], dtype=torch.float32), logits.device)
    x = logits.float() / temps[:, None]
    x = _truncate_rows(x, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
    return _draw_rows(x, list(seeds))


def _logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    lp = torch.log_softmax(raw, dim=0)
    tok_lp = float(lp[token])
    rank = int((lp > lp[token]).sum().item()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k:
        order = torch.sort(lp, descending=True, stable=True).indices[:k]
        top = tuple((int(i), float(lp[i])) for i in order)
    return TokenLogprobs(token, tok_lp, rank, top)


def no_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no penalty: the token is the raw logits' argmax (what ``sample_row`` gives
    without a grammar mask), so a batch's tokens can come from one argmax over its rows."""
    return p.greedy and no_penalties(p)


def token_logprobs(raw_logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The logprobs ``sample_row`` reports for ``token`` of a row ``[V]`` (top ``k``)."""
    return _logprobs(raw_logits.detach().to(device="cpu", dtype=torch.float32), token, k)


def sample_row(raw_logits: torch.Tensor, row: RowInput) -> SampleResult:
    """Sample one token from ``raw_logits`` ``[V]`` (any float dtype; computed in fp32)."""
    raw = raw_logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    logits = raw
    if row.allowed_mask is not None:
        logits = torch.where(row.allowed_mask, logits, torch.tensor(float("-inf")))
        if not bool(row.allowed_mask.any()):
            raise ValueError("the grammar allows no token at this point")
    logits = _apply_penalties(logits, row)
    p = row.params
    if p.greedy:
        token = int(torch.argmax(logits).item())  # first maximum: lowest id on ties
    else:
        token = sample_rows(logits[None], [p], [draw_seed(row.seed, row.output_index)])[0]
    lps = _logprobs(raw, token, p.logprobs) if p.logprobs is not None else None
    return SampleResult(token, lps)


def sample(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[SampleResult]:
    """Sample every row of ``logits`` ``[R, V]``; row i with ``rows[i]``, independently."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    return [sample_row(logits[i], row) for i, row in enumerate(rows)]
