"""`sluice bench prefix`: the pure helpers (arm order, rounds, ratios, expected cache hits,
bytes per token from the cache formula, shard bytes of an erasure-coded object)."""

from __future__ import annotations

import argparse

import pytest

from engine.cache.spec import CacheSpec
from engine.config import CSA, HCA, SLIDING
from services.bench import prefix


def test_round_order_alternates_both_pairs_and_hit_follows_write() -> None:
    for r in range(4):
        order = prefix.round_order(r)
        assert sorted(order) == sorted(prefix.ARMS)
        assert order.index("write") < order.index("hit")  # the hit reads what write stored
    even, odd = prefix.round_order(0), prefix.round_order(1)
    for arm in ("write", "hit"):  # each pair with recompute runs in both orders
        assert (even.index(arm) < even.index("recompute")) != (odd.index(arm) < odd.index("recompute"))


def test_parse_lengths_and_rounds() -> None:
    assert prefix.parse_lengths("1024, 4096,16384") == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="at least 256"):
        prefix.parse_lengths("100")
    assert prefix.parse_rounds(None, [1024, 4096, 16384]) == [25, 5, 3]
    assert prefix.parse_rounds("4", [1024, 4096]) == [4, 4]
    assert prefix.parse_rounds("7,5,2", [1024, 4096, 16384]) == [7, 5, 2]
    with pytest.raises(ValueError, match="one per length"):
        prefix.parse_rounds("1,2", [1024, 4096, 16384])
    with pytest.raises(ValueError):
        prefix.parse_rounds("0", [1024])


def test_median_ratio_is_over_pairs() -> None:
    pairs = [(1.0, 2.0), (3.0, 3.0), (10.0, 1.0)]
    assert prefix.median_ratio(pairs) == 1.0  # ratios 0.5, 1, 10
    assert prefix.median_ratio([(1.0, 4.0), (3.0, 4.0)]) == 0.5


def test_expected_cached_tokens_replays_the_window() -> None:
    replay = 6 * (128 - 1)  # small preset: 6 layers, window 128
    assert prefix.expected_cached_tokens(16384, 32, 256, replay) == 16384 - 762
    assert prefix.expected_cached_tokens(1024, 32, 256, replay) == 262
    assert prefix.expected_cached_tokens(768, 32, 256, replay) == 6  # hit 768 > replay 762
    assert prefix.expected_cached_tokens(512, 32, 256, replay) == 0  # a hit <= replay is none
    # only the prefix's full blocks are shared: the block holding the suffix differs
    assert prefix.expected_cached_tokens(1100, 32, 256, 0) == 1024
    # at least one prompt token is always computed
    assert prefix.expected_cached_tokens(1024, 0, 256, 0) == 768


def test_formula_bytes_small_preset_fp32() -> None:
    spec = CacheSpec((SLIDING, CSA, HCA, CSA, HCA, SLIDING, SLIDING), 64, 64, 128, 4, 128, 4, 4)
    got = prefix.formula_bytes(spec, 64)
    # CSA: (64 + 64) * 4 / 4 = 128 B/token; HCA: 64 * 4 / 128 = 2 B/token; two of each
    assert got["paged_bytes_per_token"] == 260.0
    assert got["paged_bytes_per_block"] == 260 * 256
    assert got["expected_bytes_per_token"] == 260.25
    assert got["header_overhead_pct"] == pytest.approx(100 * 64 / (260 * 256 + 64))


def test_shard_bytes() -> None:
    assert prefix.shard_bytes(1000, 10, 2, 64) == 12 * (64 + 100)
    assert prefix.shard_bytes(1001, 10, 2, 64) == 12 * (64 + 101)  # zero-padded to k equal shards
    assert prefix.shard_bytes(0, 10, 2, 64) == 12 * 65


def test_arguments_parse() -> None:
    p = argparse.ArgumentParser()
    prefix.add_arguments(p)
    args = p.parse_args([])
    assert args.lengths == "1024,4096,16384" and args.rounds is None and args.preset == "small"
    assert args.chunk == 2048
