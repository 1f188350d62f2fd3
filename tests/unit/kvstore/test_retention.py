"""LRU selection past the high watermark and TTL per traffic class."""

from __future__ import annotations

import pytest

from kvstore.retention import DAY_S, RetentionConfig, ShardIndex


def test_defaults_are_three_and_seven_days() -> None:
    cfg = RetentionConfig()
    assert cfg.ttl_for(1) == 3 * DAY_S and cfg.ttl_for(2) == 7 * DAY_S


def test_lru_evicts_least_recent_down_to_low_watermark() -> None:
    idx = ShardIndex(1000, RetentionConfig(high_watermark=0.9, low_watermark=0.5))
    for i in range(9):
        idx.add(f"s{i}", 100, 2, now=float(i))
    assert idx.eviction_candidates() == []
    idx.touch("s0", now=100.0)  # hot again
    victims = idx.eviction_candidates(incoming=100)
    assert victims == ["s1", "s2", "s3", "s4", "s5"]  # 900 + 100 -> <= 500
    assert "s0" not in victims


def test_ttl_per_class_counts_from_last_access() -> None:
    idx = ShardIndex(10_000, RetentionConfig(ttl_s={"agent": 10, "chat": 30}))
    idx.add("a", 1, 1, now=0.0)
    idx.add("c", 1, 2, now=0.0)
    assert idx.expired(9.9) == []
    assert idx.expired(10.0) == ["a"]
    idx.touch("c", now=20.0)
    assert idx.expired(45.0) == ["a"]
    assert set(idx.expired(50.0)) == {"a", "c"}


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        RetentionConfig(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError, match="unknown traffic classes"):
        RetentionConfig(ttl_s={"agent": 1, "chat": 1, "batch": 1})
    with pytest.raises(ValueError, match="no TTL"):
        RetentionConfig(ttl_s={"agent": 1})
