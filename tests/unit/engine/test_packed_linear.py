"""engine.model.packed_linear: the CPU's oneDNN path with a packed weight, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import packed_linear
from engine.model.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(
    not packed_linear.available(), reason="this torch has no oneDNN packed linear"
)


def _layer(bias: bool) -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear(96, 1000, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_the_linear_through_the_packed_weight(bias: bool) -> None:
    lin = _layer(bias)
    for shape in ((1, 96), (16, 96), (3, 5, 96), (0, 96)):
        x = torch.randn(shape)
        with torch.no_grad():
            assert lin.uses_packed(x)
            got = lin(x)
        want = F.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lin._packed is not None  # the packed path ran


def test_a_weight_written_in_place_or_replaced_is_packed_again() -> None:
    lin = _layer(False)
    x = torch.randn(4, 96)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(-2.0)  # written in place: its version moves
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
        lin.weight = torch.nn.Parameter(torch.randn(1000, 96))  # another tensor
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_autograd_other_dtypes_and_the_switch_take_f_linear(monkeypatch) -> None:
    lin = _layer(True)
    x = torch.randn(4, 96, requires_grad=True)
    assert not lin.uses_packed(x)  # training: F.linear, which has a backward pass
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        assert not lin.uses_packed(x.detach().double())
        monkeypatch.setattr(packed_linear, "PACKED", False)
        plain = x.detach()
        assert not lin.uses_packed(plain)
        assert torch.equal(lin(plain), F.linear(plain, lin.weight, lin.bias))


def test_a_weight_made_under_inference_mode_takes_f_linear() -> None:
    """Inference tensors keep no version counter, so a packed copy could go stale unseen."""
    with torch.inference_mode():
        lin = _layer(False)
        x = torch.randn(4, 96)
        assert not lin.uses_packed(x)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin._packed is None
