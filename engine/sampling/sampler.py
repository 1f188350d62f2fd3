"""Deterministic, batch-invariant sampling (torch, fp32, on the logits' device).

No operation mixes rows, so a row's result cannot depend on which other requests share the
batch. Randomness is one number per token, ``uniform(derive(request seed, output index))``:
the k-th token of a seeded request sees the same number alone, in any batch, under any
chunking, in synchronous or asynchronous mode, with or without speculation. The draw is the
inverse CDF (the first token whose cumulative probability exceeds that number), an exact
draw from ``p``; greedy is ``argmax`` with the lowest token id on ties. Rows with neither a
grammar nor penalties are drawn together (`sample_rows`, one pass over ``[R, V]`` on the
device); rows with either go through `draw_masked`, which adds the mask and the penalties
(on the device too), and `sample_row` runs that on one row on the host.

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


def _penalise(
    x: torch.Tensor, rows: Sequence[RowInput], state: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Repetition, presence and frequency penalties of rows ``x [R, V]`` (fp32, any device),
    each row with its own settings; a row without penalties is left as it was (its factors
    are 1 and 0). ``state``: ``(seen, counts)`` ``[R, V]`` kept on the device
    (`engine.sampling.penalties.PenaltyRows`); else built here from the rows' histories."""
    dev = x.device
    repetition = [row.params.repetition_penalty for row in rows]
    freq = [row.params.frequency_penalty for row in rows]
    pres = [row.params.presence_penalty for row in rows]
    rep_on = any(p != 1.0 for p in repetition)
    count_on = any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres)
    if not (rep_on or count_on):
        return x
    seen, counts = state if state is not None else _histories(rows, x.shape[1], dev)
    if rep_on:
        penalty = upload(torch.tensor(repetition, dtype=torch.float32), dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if count_on:
        freq_t = upload(torch.tensor(freq, dtype=torch.float32), dev)[:, None]
        pres_t = upload(torch.tensor(pres, dtype=torch.float32), dev)[:, None]
        x = x - freq_t * counts - pres_t * (counts > 0).to(torch.float32)
    return x


def _histories(rows: Sequence[RowInput], vocab: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, counts)`` ``[R, V]`` from the rows' token ids: prompt and output tokens seen,
    output tokens counted (exact: integer counts in fp32). Uploaded as ids, not as masks."""
    r = len(rows)
    seen = torch.zeros(r * vocab, dtype=torch.bool, device=dev)
    counts = torch.zeros(r * vocab, dtype=torch.float32, device=dev)
    flat = _flat_index([(*row.prompt_token_ids, *row.output_token_ids) for row in rows], vocab)
    if len(flat):  # a scalar fill: an indexed assignment of True would copy it up synchronously
        seen.scatter_(0, upload(flat, dev), True)
    flat = _flat_index([row.output_token_ids for row in rows], vocab)
    if len(flat):
        counts.index_add_(0, upload(flat, dev), torch.ones(len(flat), device=dev))
    return seen.view(r, vocab), counts.view(r, vocab)


def _flat_index(histories: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """``row * vocab + id`` (host, int64) for every in-vocabulary id of each row's history."""
    flat = [i * vocab + t for i, history in enumerate(histories) for t in history if 0 <= t < vocab]
    return torch.tensor(flat, dtype=torch.long)


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
        # the k-th largest value from a top-k of the largest k asked (not a sort of the whole
        # row): the same value; rows with top-k off keep everything
        widest = max(k for k in top_k if 0 < k < v)
        k = upload(torch.tensor([k if 0 < k < v else widest for k in top_k]), dev)
        on = upload(torch.tensor([0 < k < v for k in top_k]), dev)[:, None]
        kth = torch.topk(logits, widest, dim=-1).values.gather(1, (k - 1)[:, None])
        logits = torch.where(~on | (logits >= kth), logits, neg_inf)
    if any(p < 1.0 for p in top_p):
        ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=-1)
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


def draw_masked(
    raw_logits: torch.Tensor,
    rows: Sequence[RowInput],
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Tokens [R] (int64, on the logits' device, nothing read back) of rows ``raw_logits
    [R, V]`` with a grammar mask or penalties, row i with ``rows[i]``: mask -> penalties ->
    argmax (greedy rows) or `draw_rows`. Every operation is row by row, so a row's token is the
    one `sample_row` gives it alone. A row whose mask allows nothing must not be passed (the
    caller checks on the host, where the mask is made). ``penalties``: the rows' ``(seen,
    counts)`` kept on the device (`PenaltyRows.gather`), else built from their histories."""
    dev = raw_logits.device
    x = raw_logits.float()
    vocab = x.shape[1]
    if any(row.allowed_mask is not None for row in rows):
        everything = torch.ones(vocab, dtype=torch.bool)
        masks = torch.stack([everything if row.allowed_mask is None else row.allowed_mask for row in rows])
        x = torch.where(upload(masks, dev), x, x.new_full((), float("-inf")))
    x = _penalise(x, rows, penalties)
    tokens = x.argmax(dim=-1)  # first maximum: lowest id on ties
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = upload(torch.tensor(drawn, dtype=torch.long), dev)
        picked = x if len(drawn) == len(rows) else x[index]
        seeds = [draw_seed(rows[i].seed, rows[i].output_index) for i in drawn]
        tokens = tokens.index_copy(0, index, draw_rows(picked, [rows[i].params for i in drawn], seeds))
    return tokens


def sample_row(raw_logits: torch.Tensor, row: RowInput) -> SampleResult:
    """Sample one token from ``raw_logits`` ``[V]`` (any float dtype; computed in fp32 on the
    host): `draw_masked` on one row."""
    raw = raw_logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    if row.allowed_mask is not None and not bool(row.allowed_mask.any()):
        raise ValueError("the grammar allows no token at this point")
    token = int(draw_masked(raw[None], [row])[0])
    p = row.params
    lps = _logprobs(raw, token, p.logprobs) if p.logprobs is not None else None
    return SampleResult(token, lps)


def sample(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[SampleResult]:
    """Sample every row of ``logits`` ``[R, V]``; row i with ``rows[i]``, independently."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
    return [sample_row(logits[i], row) for i, row in enumerate(rows)]
