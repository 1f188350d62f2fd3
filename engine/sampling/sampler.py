"""Deterministic, batch-invariant sampling (torch, fp32).

Every row is processed on its own 1-D ``[V]`` tensor: no operation mixes rows, so a row's
result cannot depend on which other requests share the batch. Randomness comes from a
``torch.Generator`` seeded with ``derive(request seed, output index)``: the k-th token of a
seeded request sees the same random numbers alone, in any batch, under any chunking, in
synchronous or asynchronous mode. Sampling is the exponential race
``argmax(p_i / E_i), E_i ~ Exp(1)``, an exact draw from ``p``; greedy is ``argmax`` with the
lowest token id on ties.

Order per row: grammar mask -> repetition/presence/frequency penalties -> temperature ->
top-k -> top-p -> min-p -> draw. Logprobs are those of the model's raw distribution
(log_softmax of the unprocessed logits), as vLLM v1 returns by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def _truncate(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k, top-p and min-p on temperature-scaled logits; removed tokens get -inf."""
    neg_inf = torch.tensor(float("-inf"))
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = torch.where(logits >= kth, logits, neg_inf)
    if p.top_p < 1.0:
        order = torch.sort(logits, descending=True, stable=True).indices
        probs = torch.softmax(logits[order], dim=0)
        cum = torch.cumsum(probs, dim=0)
        drop_sorted = (cum - probs) >= p.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted)
        drop[order] = drop_sorted
        logits = torch.where(drop, neg_inf, logits)
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=0)
        logits = torch.where(probs >= p.min_p * probs.max(), logits, neg_inf)
    return logits


def _draw(logits: torch.Tensor, seed: int) -> int:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    noise = torch.empty(logits.shape[0], dtype=torch.float32).exponential_(generator=gen)  # [V]
    probs = torch.softmax(logits, dim=0)
    return int(torch.argmax(probs / noise).item())


def _logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    lp = torch.log_softmax(raw, dim=0)
    tok_lp = float(lp[token])
    rank = int((lp > lp[token]).sum().item()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k:
        order = torch.sort(lp, descending=True, stable=True).indices[:k]
        top = tuple((int(i), float(lp[i])) for i in order)
    return TokenLogprobs(token, tok_lp, rank, top)


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with no penalty: the token is the raw logits' argmax (what ``sample_row`` gives
    without a grammar mask), so a batch's tokens can come from one argmax over its rows."""
    return (
        p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    )


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
        logits = _truncate(logits / p.temperature, p)
        token = _draw(logits, derive_seed(row.seed, f"tok:{row.output_index}"))
    lps = _logprobs(raw, token, p.logprobs) if p.logprobs is not None else None
    return SampleResult(token, lps)


def sample(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[SampleResult]:
    """Sample every row of ``logits`` ``[R, V]``; row i with ``rows[i]``, independently."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    return [sample_row(logits[i], row) for i, row in enumerate(rows)]
