"""Rotary's shared cos/sin tables: a hit is exactly the recomputation, and only the same
positions tensor (at the same version) hits."""

from __future__ import annotations

import torch

from engine.config import RopeConfig
from engine.model.rope import Rotary


def _fresh(
    rot: Rotary, pos: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos.float()[:, None] * rot.inv_freq[None, :]
    return freqs.cos().to(dtype).repeat_interleave(2, -1), freqs.sin().to(dtype).repeat_interleave(2, -1)


def test_rotaries_of_one_flavour_share_tables_and_never_serve_stale_ones() -> None:
    cfg = RopeConfig(theta=160000.0, rope_dim=16, factor=16.0, original_max_position=4096)
    a, b = Rotary(cfg), Rotary(cfg)
    other = Rotary(RopeConfig(theta=10000.0, rope_dim=16))
    pos = torch.tensor([0, 5, 4095, 70000])
    first = a.cos_sin(pos, torch.float32)
    assert all(x is y for x, y in zip(first, b.cos_sin(pos, torch.float32)))  # shared: a hit
    assert all(torch.equal(x, y) for x, y in zip(first, _fresh(a, pos)))
    assert not torch.equal(other.cos_sin(pos, torch.float32)[1], first[1])  # another flavour
    pos[1] = 6  # changed in place: the version moves, the tables are recomputed
    assert all(torch.equal(x, y) for x, y in zip(a.cos_sin(pos, torch.float32), _fresh(a, pos)))
    same_values = pos.clone()
    assert all(
        torch.equal(x, y) for x, y in zip(a.cos_sin(same_values, torch.float32), _fresh(a, same_values))
    )
    with torch.inference_mode():
        p2 = torch.tensor([1, 2, 3])
        assert all(
            torch.equal(x, y) for x, y in zip(a.cos_sin(p2, torch.bfloat16), _fresh(a, p2, torch.bfloat16))
        )
