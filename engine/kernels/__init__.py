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
