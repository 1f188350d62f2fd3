"""MXFP8: the codec's round-trip bounds, and MXFP8 slot payloads (lossy, marked, verified)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from engine.cache import mxfp8
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from engine.kvconnector.caches import pack_slot, unpack_slot_into
from engine.kvconnector.payload import KIND_SLOT, PayloadError, decode, layout_digest

FP = hashlib.sha256(b"model a").digest()


def _bound(x: torch.Tensor) -> torch.Tensor:
    """Per element: 2**-4 relative in E4M3's normal range, else 2**-10 of the block's scale,
    which is at most amax / 224 (the block's largest value lands in (224, 448])."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    floor = blocks.abs().amax(-1) / 224 * 2**-10
    return torch.maximum(blocks.abs() * 2**-4, floor[..., None]).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_format_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 512, generator=g) * torch.logspace(-8, 4, 512)).to(dtype)
    values, scales = mxfp8.encode(x)
    assert values.dtype == scales.dtype == torch.uint8 and scales.shape == (6, 16)
    assert values.numel() + scales.numel() == mxfp8.encoded_bytes(x.numel()) == 6 * 528
    y = mxfp8.decode(values, scales, torch.float32)
    assert ((y - x.float()).abs() <= _bound(x)).all()
    # the block maximum keeps its order of magnitude (no saturation at 448 x scale)
    assert torch.allclose(y.abs().amax(-1), x.float().abs().amax(-1), rtol=2**-4)
    zeros = torch.zeros(2, 64, dtype=dtype)
    assert torch.equal(mxfp8.decode(*mxfp8.encode(zeros), dtype), zeros)


def test_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.encode(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="non-finite"):
        mxfp8.encode(torch.tensor([float("inf")] + [0.0] * 31))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.encoded_bytes(33)


def test_an_mxfp8_slot_payload_round_trips_within_the_bounds_and_says_its_format():
    spec = CacheSpec.from_model(ModelConfig.from_dict(preset_config("tiny")))
    src, dst = SWASlots(spec, 2, torch.float32, "cpu"), SWASlots(spec, 2, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    for t in src._all():
        t.copy_(torch.randn(t.shape, generator=g))
    digest = layout_digest(spec, torch.float32)
    native = pack_slot(src, 1, FP, digest)
    lossy = pack_slot(src, 1, FP, digest, fmt="mxfp8")
    meta = decode(lossy, kind=KIND_SLOT, fingerprint=FP, digest=digest, dtype=torch.float32).meta
    assert meta["format"] == "mxfp8"
    assert len(lossy) < 0.3 * len(native)  # 33 bytes per 32 values instead of 128 (fp32)
    assert unpack_slot_into(lossy, dst, 0, FP, digest)["format"] == "mxfp8"
    for a, b in zip(src.slot_tensors(1), dst.slot_tensors(0)):
        if a.shape[-1] % 32:
            assert torch.equal(a, b)  # stored as it is
        else:
            assert ((a - b).abs() <= _bound(a)).all() and not torch.equal(a, b)
    corrupt = bytearray(lossy)
    corrupt[-40] ^= 0xFF
    with pytest.raises(PayloadError):
        unpack_slot_into(bytes(corrupt), dst, 1, FP, digest)
    with pytest.raises(ValueError, match="slot format"):
        pack_slot(src, 1, FP, digest, fmt="fp4")
