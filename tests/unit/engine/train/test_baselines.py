"""Unigram and bigram baselines: proper distributions, and the bigram wins on held-out."""

from __future__ import annotations

import json

import numpy as np

from engine.train.baselines import Bigram, Unigram, perplexity
from engine.train.data import read_array


def test_distributions_sum_to_one():
    rng = np.random.default_rng(0)
    v = 50
    stream = rng.integers(0, 20, size=2000)
    uni = Unigram.fit(stream, v, k=0.1)
    bi = Bigram.fit(stream, v, d=0.75, boundary=0)
    everything = np.arange(v)
    assert np.isclose(np.exp(-uni.nll(everything, 0)).sum(), 1.0)
    for ctx in (0, 3, 19, 42):  # 42 never seen as a context
        # P(w | ctx) for every w: the stream [w] with boundary=ctx scores exactly that pair
        p = np.array([np.exp(-bi.nll(np.array([w]), ctx))[0] for w in range(v)])
        assert np.isclose(p.sum(), 1.0), ctx
        assert (p > 0).all()


def test_bigram_learns_a_deterministic_chain():
    stream = np.tile(np.arange(10), 200)
    held = np.tile(np.arange(10), 5)
    assert perplexity(Bigram.fit(stream, 16, 0.75, 9), held, 9) < 1.5
    assert perplexity(Unigram.fit(stream, 16, 0.1), held, 9) > 9


def test_bigram_beats_unigram_on_heldout(built):
    header = json.loads((built / "data.json").read_text())
    b = header["baselines"]
    assert b["bigram_heldout_ppl"] < b["unigram_heldout_ppl"]
    assert b["bigram_heldout_ppl"] < 0.5 * b["unigram_heldout_ppl"]
    held = read_array(built, "heldout")
    assert len(held) == header["arrays"]["heldout"]["n_tokens"]
    assert held.max() < 1024 and held[-1] == header["tokenizer"]["eos"]
