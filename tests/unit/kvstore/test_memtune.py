"""Allocator tuning for large-buffer processes."""

from __future__ import annotations

import pytest


def test_tune_malloc_validates_and_applies() -> None:
    from kvstore.memtune import tune_malloc

    with pytest.raises(ValueError, match="mmap threshold"):
        tune_malloc(mmap_threshold=64 << 20)
    assert tune_malloc() is True  # glibc (Debian) here
