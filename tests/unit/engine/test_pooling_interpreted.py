"""The compressors' pooling kernel (`engine.kernels.pooling`) in Triton's interpreter on the CPU:
its logic against the eager `Compressor._pool`, alone and inside the engine's prefill. Runs
where Triton is installed (the CPU suite skips it otherwise); on a GPU the kernel's check is
`tests/gpu/test_kernels.py::test_the_pooling_kernel_matches_the_eager_pooling`. fp32 and fp16
only: the interpreter's bf16 products are not the GPU's.

The interpreter must be chosen before Triton is first imported (``TRITON_INTERPRET=1``), so
the checks run in a child process (`check_kernel`, `check_engine`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def check_kernel() -> None:
    """The kernel against `Compressor._pool`: overlapping and not, from window 0 and later."""
    from engine.kernels import pooling
    from engine.model.compressor import Compressor

    g = torch.Generator().manual_seed(0)
    for overlap, rate, dim in ((True, 4, 24), (False, 8, 40), (False, 128, 64)):
        comp = Compressor(16, dim, rate, overlap, 1e-6)
        with torch.no_grad():
            comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
        width = 2 * dim if overlap else dim
        for dtype in (torch.float32, torch.float16):
            for w0, nw in ((0, 5), (3, 4), (1, 1)):
                lo = max(0, w0 * rate - (rate if overlap else 0))
                a = w0 * rate - lo
                kv = torch.randn(a + nw * rate + 3, width, generator=g).to(dtype)
                gate = (torch.randn(kv.shape, generator=g) * 3).to(dtype)
                want = comp._pool(kv, gate, a, w0, nw)
                got = pooling.pool(kv, gate, comp.position_bias.detach(), a, w0, nw, rate, dim, overlap)
                tol = 1e-5 if dtype == torch.float32 else 2e-3
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
                if nw > 1:  # a window is the same computed alone
                    one = pooling.pool(
                        kv, gate, comp.position_bias.detach(), a + rate, w0 + 1, 1, rate, dim, overlap
                    )
                    assert torch.equal(one[0], got[1])


def check_engine() -> None:
    """Every layer type, a 70-token prompt in chunks of 40 and 30 (windows close in both steps,
    the second reads the ring the first wrote): the same logits through the kernel."""
    from engine.forward_batch import ForwardBatch, SequenceInput
    from engine.kernels import pooling
    from engine.runner import ModelRunner, RunnerConfig
    from tests.unit.engine.refmodel import build_reference

    calls = []
    pool = pooling.pool
    pooling.pool = lambda *a, **k: calls.append(a[3:]) or pool(*a, **k)
    pooling.usable = lambda kv: pooling.FUSED_POOLING and not kv.requires_grad  # CPU tensors too
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    for name in ("mixed_hc2", "csa_small_topk"):
        path = Path(tempfile.mkdtemp()) / name
        path.mkdir()
        build_reference(path, name)

        def logits(path: Path = path) -> torch.Tensor:
            runner = ModelRunner(path, RunnerConfig(num_blocks=2, num_slots=1))
            batches = [
                ForwardBatch.from_sequences([SequenceInput(ids[s:e], s, 0, [0, 1])])
                for s, e in ((0, 40), (40, 70))
            ]
            return torch.stack([runner.execute(b).logits[0] for b in batches])

        pooling.FUSED_POOLING = False
        want = logits()
        assert not calls
        pooling.FUSED_POOLING = True
        got = logits()
        assert calls, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        calls.clear()


@pytest.mark.parametrize("check", ["check_kernel", "check_engine"])
def test_the_pooling_kernel_in_tritons_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    code = f"import tests.unit.engine.test_pooling_interpreted as t; t.{check}()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
