"""Unigram and bigram baselines over token ids (numpy only).

* Unigram: add-k smoothing, ``P(w) = (c(w) + k) / (N + k V)``.
* Bigram: interpolated Kneser-Ney with one absolute discount ``d``, backing off to the
  continuation unigram, which is itself discounted and interpolated with the uniform
  distribution over the ``V`` ids, so every id has non-zero probability:

  ``P(w|v) = max(c(v,w) - d, 0) / c(v) + d N1+(v,.) / c(v) * Pc(w)`` (``Pc(w)`` when ``c(v) = 0``),
  ``Pc(w) = max(N1+(.,w) - d, 0) / N1+(.,.) + d |{w: N1+(.,w) > 0}| / N1+(.,.) / V``.

``k`` and ``d`` are chosen by grid search on a validation stream (the ``valid-v1`` slice of
the training split), fitting on the rest of the training split; the chosen values are then
refitted on the whole training split and evaluated once on held-out.

A stream is one 1-D array of ids: each file's ids followed by EOS. Every position is
predicted; the bigram's context for position 0 is EOS (a file boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

K_GRID = (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0)
D_GRID = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


@dataclass(frozen=True)
class Unigram:
    counts: np.ndarray  # float64, length V
    k: float

    @classmethod
    def fit(cls, stream: np.ndarray, vocab_size: int, k: float) -> Unigram:
        return cls(np.bincount(stream, minlength=vocab_size).astype(np.float64), k)

    def nll(self, stream: np.ndarray, boundary: int) -> np.ndarray:
        del boundary
        v = len(self.counts)
        p = (self.counts[stream] + self.k) / (self.counts.sum() + self.k * v)
        return -np.log(p)


@dataclass(frozen=True)
class Bigram:
    vocab_size: int
    d: float
    pair_codes: np.ndarray  # sorted unique prev * V + next
    pair_counts: np.ndarray
    ctx_counts: np.ndarray  # c(v)
    ctx_types: np.ndarray  # N1+(v, .)
    cont: np.ndarray  # Pc(w)

    @classmethod
    def fit(cls, stream: np.ndarray, vocab_size: int, d: float, boundary: int) -> Bigram:
        v = vocab_size
        prev = np.concatenate([[boundary], stream[:-1]]).astype(np.int64)
        codes = prev * v + stream.astype(np.int64)
        pair_codes, pair_counts = np.unique(codes, return_counts=True)
        ctx = pair_codes // v
        nxt = pair_codes % v
        ctx_counts = np.bincount(ctx, weights=pair_counts, minlength=v)
        ctx_types = np.bincount(ctx, minlength=v).astype(np.float64)
        n1_into = np.bincount(nxt, minlength=v).astype(np.float64)
        total_types = float(len(pair_codes))
        cont = np.maximum(n1_into - d, 0.0) / total_types + d * np.count_nonzero(n1_into) / total_types / v
        return cls(v, d, pair_codes, pair_counts.astype(np.float64), ctx_counts, ctx_types, cont)

    def nll(self, stream: np.ndarray, boundary: int) -> np.ndarray:
        v = self.vocab_size
        prev = np.concatenate([[boundary], stream[:-1]]).astype(np.int64)
        nxt = stream.astype(np.int64)
        codes = prev * v + nxt
        pos = np.searchsorted(self.pair_codes, codes)
        pos_c = np.minimum(pos, len(self.pair_codes) - 1)
        found = self.pair_codes[pos_c] == codes
        c_vw = np.where(found, self.pair_counts[pos_c], 0.0)
        c_v = self.ctx_counts[prev]
        seen = c_v > 0
        safe = np.where(seen, c_v, 1.0)
        p_seen = np.maximum(c_vw - self.d, 0.0) / safe + self.d * self.ctx_types[prev] / safe * self.cont[nxt]
        p = np.where(seen, p_seen, self.cont[nxt])
        return -np.log(p)


def perplexity(model: Unigram | Bigram, stream: np.ndarray, boundary: int) -> float:
    return float(np.exp(model.nll(stream, boundary).mean()))


@dataclass(frozen=True)
class BaselineReport:
    unigram_k: float
    bigram_d: float
    unigram_valid_ppl: float
    bigram_valid_ppl: float
    unigram_heldout_ppl: float
    bigram_heldout_ppl: float

    def to_json(self) -> dict[str, float]:
        return dict(self.__dict__)


def fit_baselines(
    fit_stream: np.ndarray,
    valid_stream: np.ndarray,
    train_stream: np.ndarray,
    heldout_stream: np.ndarray,
    vocab_size: int,
    boundary: int,
) -> BaselineReport:
    """Tune on (fit, valid), refit on the whole training stream, evaluate on held-out."""
    uni = {k: perplexity(Unigram.fit(fit_stream, vocab_size, k), valid_stream, boundary) for k in K_GRID}
    k = min(uni, key=lambda x: (uni[x], x))
    bi = {
        d: perplexity(Bigram.fit(fit_stream, vocab_size, d, boundary), valid_stream, boundary) for d in D_GRID
    }
    d = min(bi, key=lambda x: (bi[x], x))
    return BaselineReport(
        unigram_k=k,
        bigram_d=d,
        unigram_valid_ppl=uni[k],
        bigram_valid_ppl=bi[d],
        unigram_heldout_ppl=perplexity(Unigram.fit(train_stream, vocab_size, k), heldout_stream, boundary),
        bigram_heldout_ppl=perplexity(
            Bigram.fit(train_stream, vocab_size, d, boundary), heldout_stream, boundary
        ),
    )
