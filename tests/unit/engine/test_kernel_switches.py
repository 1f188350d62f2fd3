"""When the Triton kernels may replace eager code (engine.kernels): never under autograd,
whose backward they lack, and never after `set_kernels(False)`."""

from __future__ import annotations

import torch

from engine.kernels import kernels_on, set_kernels, tracks_grad


def test_tracks_grad_only_when_autograd_records_the_op() -> None:
    leaf = torch.zeros(3, requires_grad=True)
    plain = torch.zeros(3)
    assert tracks_grad(plain, leaf)
    assert not tracks_grad(plain)
    with torch.no_grad():
        assert not tracks_grad(leaf)
    with torch.inference_mode():  # the engine's forward
        assert not tracks_grad(leaf)


def test_set_kernels_turns_every_kernel_off_and_back() -> None:
    before = kernels_on()
    try:
        set_kernels(False)
        assert not kernels_on()
    finally:
        set_kernels(True)
    assert kernels_on() == before  # on again where Triton imports (off without it)
