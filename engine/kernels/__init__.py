"""GPU kernels (Triton) for decode hot spots, each beside the eager torch code it replaces.

A kernel is used only on CUDA tensors when Triton imports; everywhere else (CPU, a GPU host
without Triton) the eager code runs. Each kernel is per token, so a token's result never
depends on the batch around it (batch invariance), and tests/gpu compares it with the eager
code it replaces.
"""

from __future__ import annotations

import functools


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


def set_kernels(on: bool) -> None:
    """Process-wide: run the eager code instead of these kernels (``False``), e.g. to measure
    what they are worth in one process (``sluice bench engine --preset P --no-kernels``)."""
    _ON[0] = bool(on)
