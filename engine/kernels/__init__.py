"""GPU kernels (Triton) for decode and prefill hot spots, each beside the eager torch code it replaces.

A kernel is used only on CUDA tensors when Triton imports, and outside autograd (`tracks_grad`:
the kernels have no backward pass); everywhere else (CPU, a GPU host without Triton,
training) the eager code runs. Each kernel is per token, so a token's result never
depends on the batch around it (batch invariance), and tests/gpu compares it with the eager
code it replaces.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


_ON = [True]


def kernels_on() -> bool:
    """Whether the kernels that replace eager code (not the batch-invariant mode's own) run:
    Triton imports and `set_kernels` has not turned them off."""
    return _ON[0] and triton_available()


def tracks_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records ops on these tensors (training): the kernels have no backward
    pass, so the eager code runs then."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def set_kernels(on: bool) -> None:
    """Process-wide: run the eager code instead of these kernels (``False``), e.g. to measure
    what they are worth in one process (``sluice bench engine --preset P --no-kernels``)."""
    _ON[0] = bool(on)
