"""Reference checkpoints shared by the engine tests (built once per session)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.refmodel import CONFIGS, build_reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """name -> (checkpoint dir, fp32 transformers reference model)."""
    built: dict[str, tuple] = {}

    def get(name: str):
        if name not in built:
            d = tmp_path_factory.mktemp(f"v4-{name}")
            built[name] = (d, build_reference(d, name))
        return built[name]

    return get


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[S, vocab] logits of every position of one sequence, one-shot (no cache)."""
    with torch.no_grad():
        return model(ids[None], use_cache=False).logits[0].float()


ALL = sorted(CONFIGS)
