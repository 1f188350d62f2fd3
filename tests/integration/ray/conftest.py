"""Fixtures shared by the Ray integration tests: the tiny checkpoint and a single-engine reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core import EngineConfig, EngineCore


@pytest.fixture(scope="module")
def model(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny")


@pytest.fixture(scope="module")
def ref(model) -> Iterator[EngineCore]:
    """One engine in the test process, prefix cache off: what the actors must reproduce."""
    c = EngineCore(EngineConfig(model=str(model), enable_prefix_caching=False))
    yield c
    c.close()
