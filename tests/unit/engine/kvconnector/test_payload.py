"""The KV payload byte format: bit-exact round trips, and every refusal leaves the destination alone."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import struct

import pytest
import torch
import xxhash

from engine.cache.pool import CompressedPool
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots
from engine.checkpoint.presets import preset_config
from engine.config import ModelConfig
from engine.kvconnector.caches import pack_block, pack_slot, unpack_block_into, unpack_slot_into
from engine.kvconnector.payload import (
    FORMAT_VERSION,
    HEADER_BYTES_BLOCK,
    KIND_BLOCK,
    KIND_SEQUENCE,
    KIND_SLOT,
    MAX_META_BYTES,
    PayloadError,
    block_body_bytes,
    block_payload_bytes,
    decode,
    encode,
    layout_digest,
)

SPEC = CacheSpec.from_model(ModelConfig.from_dict(preset_config("tiny")))
FP = hashlib.sha256(b"model a").digest()  # 32 bytes; the format keeps the first 16
FP_OTHER = hashlib.sha256(b"model b").digest()
DTYPES = [torch.float32, torch.bfloat16]


def _randomise(tensors: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g))


def _pool(dtype: torch.dtype, spec: CacheSpec = SPEC, seed: int | None = None) -> CompressedPool:
    pool = CompressedPool(spec, 4, dtype, "cpu")  # rows[l]: [4, rpb_l, dim]
    if seed is not None:
        _randomise([*pool.rows.values(), *pool.index_rows.values()], seed)
    return pool


def _swa(dtype: torch.dtype, spec: CacheSpec = SPEC, seed: int | None = None) -> SWASlots:
    swa = SWASlots(spec, 3, dtype, "cpu")  # window[l]: [3, W, head_dim], state rings [3, R, C]
    if seed is not None:
        _randomise(swa._all(), seed)
    return swa


def _raw(tensors: list[torch.Tensor]) -> list[bytes]:
    """Bit patterns (so bf16 and NaN-free float compare exactly)."""
    return [bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]


def _block_fixture(dtype: torch.dtype = torch.float32):
    """(payload of src block 2, dst pool, dst block, digest, dst block's bytes before)."""
    digest = layout_digest(SPEC, dtype)
    src, dst = _pool(dtype, seed=1), _pool(dtype, seed=2)
    payload = pack_block(src, 2, FP, digest)
    return payload, dst, 1, digest, _raw(dst.block_tensors(1))


def _refused(payload: bytes, dst: CompressedPool, block: int, digest: bytes, before: list[bytes]) -> str:
    with pytest.raises(PayloadError) as info:
        unpack_block_into(payload, dst, block, FP, digest)
    assert _raw(dst.block_tensors(block)) == before, "a refused payload wrote into the pool"
    return str(info.value)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    digest = layout_digest(SPEC, dtype)
    src, dst = _pool(dtype, seed=1), _pool(dtype)
    payload = pack_block(src, 2, FP, digest)
    assert len(payload) == block_payload_bytes(SPEC, dtype)
    unpack_block_into(payload, dst, 1, FP, digest)
    assert _raw(dst.block_tensors(1)) == _raw(src.block_tensors(2))
    zeros = _raw(_pool(dtype).block_tensors(0))
    assert all(_raw(dst.block_tensors(b)) == zeros for b in (0, 2, 3))  # only block 1 written


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_round_trip_is_bit_exact_with_metadata(dtype: torch.dtype) -> None:
    digest = layout_digest(SPEC, dtype)
    src, dst = _swa(dtype, seed=3), _swa(dtype)
    meta = {"image_hashes": ["3fa2" * 8], "host_slot": {"id": 7, "n": 321}, "x": "é"}
    payload = pack_slot(src, 1, FP, digest, meta)
    assert unpack_slot_into(payload, dst, 2, FP, digest) == meta
    assert _raw(dst.slot_tensors(2)) == _raw(src.slot_tensors(1))
    assert _raw(dst.slot_tensors(0)) == _raw(_swa(dtype).slot_tensors(0))
    assert sum(len(b) for b in _raw(src.slot_tensors(0))) == src.nbytes_per_slot()


def test_generic_sections_and_section_checksums() -> None:
    digest = layout_digest(SPEC, torch.bfloat16)
    t = torch.randn(3, 5, dtype=torch.bfloat16)
    payload = encode(KIND_SEQUENCE, FP, digest, torch.bfloat16, [b"abc", memoryview(b""), t], {"k": [1]})
    dec = decode(payload, kind=KIND_SEQUENCE, fingerprint=FP[:16], digest=digest, dtype=torch.bfloat16)
    assert dec.meta == {"k": [1]}
    assert [bytes(s) for s in dec.sections[:2]] == [b"abc", b""]
    back = torch.frombuffer(bytearray(dec.sections[2]), dtype=torch.bfloat16).view(3, 5)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))
    bad = bytearray(payload)
    bad[-1] ^= 1
    with pytest.raises(PayloadError, match="checksum mismatch in section 2"):
        decode(bytes(bad), kind=KIND_SEQUENCE, fingerprint=FP, digest=digest, dtype=torch.bfloat16)


# ------------------------------------------------------------------ identity refusals
def test_other_model_dtype_layout_or_kind_is_refused() -> None:
    payload, dst, block, digest, before = _block_fixture()
    with pytest.raises(PayloadError, match=r"model fingerprint mismatch \(payload "):
        unpack_block_into(payload, dst, block, FP_OTHER, digest)
    bf16 = pack_block(_pool(torch.bfloat16, seed=4), 0, FP, layout_digest(SPEC, torch.bfloat16))
    assert "payload dtype bfloat16, this engine's cache is float32" in _refused(
        bf16, dst, block, digest, before
    )
    wide = dataclasses.replace(SPEC, window=2 * SPEC.window)
    other_layout = pack_block(_pool(torch.float32, wide, seed=5), 0, FP, layout_digest(wide, torch.float32))
    assert "cache layout mismatch" in _refused(other_layout, dst, block, digest, before)
    slot = pack_slot(_swa(torch.float32, seed=6), 0, FP, digest)
    assert "payload kind 2 (slot), expected 1 (block)" in _refused(slot, dst, block, digest, before)
    assert _raw(dst.block_tensors(block)) == before


def test_body_size_is_checked_against_the_destination() -> None:
    """A caller passing a digest that does not describe its pool still cannot corrupt it."""
    narrow = dataclasses.replace(SPEC, head_dim=SPEC.head_dim // 2)
    payload, dst, block, digest, before = _block_fixture()
    liar = pack_block(_pool(torch.float32, narrow, seed=7), 0, FP, digest)
    assert "block body is" in _refused(liar, dst, block, digest, before)


def test_layout_digest_separates_layouts() -> None:
    d = layout_digest(SPEC, torch.float32)
    assert len(d) == 8 and d == layout_digest(dataclasses.replace(SPEC), torch.float32)
    others = [
        layout_digest(SPEC, torch.bfloat16),
        layout_digest(dataclasses.replace(SPEC, window=64), torch.float32),
        layout_digest(dataclasses.replace(SPEC, index_head_dim=32), torch.float32),
        layout_digest(dataclasses.replace(SPEC, layer_types=SPEC.layer_types[:-1]), torch.float32),
    ]
    assert len({d, *others}) == 5
    with pytest.raises(PayloadError, match="no payload code"):
        layout_digest(SPEC, torch.int8)


# ------------------------------------------------------------------ damaged bytes
def test_every_truncation_is_refused() -> None:
    payload, dst, block, digest, before = _block_fixture()
    rng = random.Random(0)
    cuts = [*range(HEADER_BYTES_BLOCK + 8), *rng.sample(range(HEADER_BYTES_BLOCK, len(payload)), 60)]
    for cut in [*cuts, len(payload) - 1]:
        assert "truncated" in _refused(payload[:cut], dst, block, digest, before), cut
    assert f"header says {len(payload) - HEADER_BYTES_BLOCK} body bytes, got 100" in _refused(
        payload[: HEADER_BYTES_BLOCK + 100], dst, block, digest, before
    )


def test_trailing_bytes_are_refused() -> None:
    payload, dst, block, digest, before = _block_fixture()
    assert "trailing bytes" in _refused(payload + b"\0", dst, block, digest, before)


def test_wrong_version_and_magic_are_refused() -> None:
    payload, dst, block, digest, before = _block_fixture()
    v7 = bytearray(payload)
    struct.pack_into("<H", v7, 4, 7)
    msg = f"payload format version 7, this engine reads {FORMAT_VERSION}"
    assert msg in _refused(bytes(v7), dst, block, digest, before)
    head = HEADER_BYTES_BLOCK - 8  # a well-formed v7 header (valid checksum) reads the same
    struct.pack_into("<Q", v7, head, xxhash.xxh3_64_intdigest(bytes(v7[:head])))
    assert msg in _refused(bytes(v7), dst, block, digest, before)
    assert "not a Sluice KV payload" in _refused(b"PK\3\4" + payload[4:], dst, block, digest, before)


def test_flipped_bits_anywhere_are_refused() -> None:
    payload, dst, block, digest, before = _block_fixture()
    rng = random.Random(1)
    positions = [*range(HEADER_BYTES_BLOCK), *rng.sample(range(HEADER_BYTES_BLOCK, len(payload)), 136)]
    for pos in positions:
        bad = bytearray(payload)
        bad[pos] ^= 1 << rng.randrange(8)
        _refused(bytes(bad), dst, block, digest, before)


# ------------------------------------------------------------------ sizes, metadata, arguments
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_header_overhead_under_one_percent(dtype: torch.dtype) -> None:
    assert HEADER_BYTES_BLOCK == 64
    body = block_body_bytes(SPEC, dtype)
    assert body == dataclasses.replace(SPEC, elem_bytes=dtype.itemsize).paged_bytes_per_block()
    assert HEADER_BYTES_BLOCK / body < 0.01


def test_metadata_is_bounded_and_reserved_keys_typed() -> None:
    digest = layout_digest(SPEC, torch.float32)
    swa = _swa(torch.float32)
    with pytest.raises(PayloadError, match="limit"):
        pack_slot(swa, 0, FP, digest, {"pad": "x" * MAX_META_BYTES})
    with pytest.raises(PayloadError, match="image_hashes"):
        pack_slot(swa, 0, FP, digest, {"image_hashes": ["not hex"]})
    with pytest.raises(PayloadError, match="host_slot"):
        pack_slot(swa, 0, FP, digest, {"host_slot": [1]})
    with pytest.raises(PayloadError, match="JSON"):
        pack_slot(swa, 0, FP, digest, {"x": float("nan")})


def test_bad_arguments() -> None:
    digest = layout_digest(SPEC, torch.float32)
    pool = _pool(torch.float32)
    with pytest.raises(IndexError):
        pack_block(pool, 4, FP, digest)
    with pytest.raises(IndexError):
        _swa(torch.float32).slot_tensors(-1)
    with pytest.raises(PayloadError, match="fingerprint must be"):
        pack_block(pool, 0, b"short", digest)
    with pytest.raises(PayloadError, match="layout digest must be"):
        pack_block(pool, 0, FP, digest + b"x")
    with pytest.raises(PayloadError, match="unknown payload kind"):
        encode(9, FP, digest, torch.float32, [])
    assert KIND_BLOCK != KIND_SLOT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_round_trip_between_cpu_and_cuda_pools() -> None:
    digest = layout_digest(SPEC, torch.bfloat16)
    src = _pool(torch.bfloat16, seed=8)
    dst = CompressedPool(SPEC, 4, torch.bfloat16, "cuda")
    unpack_block_into(pack_block(src, 3, FP, digest), dst, 0, FP, digest)
    back = _pool(torch.bfloat16)
    unpack_block_into(pack_block(dst, 0, FP, digest), back, 2, FP, digest)
    assert _raw(back.block_tensors(2)) == _raw(src.block_tensors(3))
