"""The erasure codec: round trips, any m losses, corruption treated as loss, named errors."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from kvstore.codec import (
    Codec,
    CodecConfig,
    ShardCountMismatch,
    ShardSizeMismatch,
    TooFewShards,
    backend_names,
    new_object_id,
)
from kvstore.shardfmt import Shard, ShardHeader, checksum


def _flip(shard: Shard, pos: int) -> Shard:
    payload = bytearray(shard.payload)
    payload[pos % len(payload)] ^= 0x10
    return Shard(shard.header, bytes(payload))


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 159, 160, 161, 4095, 4096, 4097, 40960, 40961, 100_003])
def test_round_trip_every_backend_and_boundary(backend: str, size: int) -> None:
    codec = Codec(CodecConfig(backend=backend))
    data = os.urandom(size)
    shards = codec.encode(new_object_id(), data)
    assert len(shards) == 12
    assert len({len(s.payload) for s in shards}) == 1
    assert codec.verify(shards)
    assert codec.decode(shards) == data


def test_any_two_missing_decode_and_reconstruct_byte_identical() -> None:
    codec = Codec()
    data = os.urandom(12_345)
    shards = codec.encode(new_object_id(), data)
    for lost in itertools.combinations(range(12), 2):
        holed: list[Shard | None] = [None if i in lost else s for i, s in enumerate(shards)]
        assert codec.decode(holed) == data
        rebuilt = codec.reconstruct(holed)
        assert [s.to_bytes() for s in rebuilt] == [s.to_bytes() for s in shards]


def test_three_missing_raises_too_few_shards() -> None:
    codec = Codec()
    shards: list[Shard | None] = list(codec.encode(new_object_id(), os.urandom(1000)))
    shards[0] = shards[5] = shards[11] = None
    with pytest.raises(TooFewShards) as info:
        codec.decode(shards)
    assert (info.value.have, info.value.need) == (9, 10)
    with pytest.raises(TooFewShards):
        codec.reconstruct(shards)


@pytest.mark.parametrize("bad", [(3,), (0, 11), (4, 9)])
def test_corrupt_shards_are_treated_as_missing(bad: tuple[int, ...]) -> None:
    codec = Codec()
    data = os.urandom(50_000)
    shards = codec.encode(new_object_id(), data)
    damaged: list[Shard | None] = [_flip(s, 777) if i in bad else s for i, s in enumerate(shards)]
    assert not codec.verify(damaged)
    assert codec.decode(damaged) == data
    assert sorted(set(range(12)) - set(codec.valid(damaged))) == list(bad)
    repaired = codec.reconstruct(damaged)
    assert codec.verify(repaired)
    assert [s.to_bytes() for s in repaired] == [s.to_bytes() for s in shards]


def test_three_corrupt_never_returns_wrong_bytes() -> None:
    codec = Codec()
    shards = codec.encode(new_object_id(), os.urandom(9_999))
    damaged: list[Shard | None] = [_flip(s, 1) if i in (1, 2, 3) else s for i, s in enumerate(shards)]
    with pytest.raises(TooFewShards):
        codec.decode(damaged)


def test_truncated_or_extended_payload_is_missing() -> None:
    codec = Codec()
    data = os.urandom(30_000)
    shards = codec.encode(new_object_id(), data)
    damaged: list[Shard | None] = list(shards)
    damaged[2] = Shard(shards[2].header, shards[2].payload[:-1])
    damaged[7] = Shard(shards[7].header, bytes(shards[7].payload) + b"\0")
    assert set(codec.valid(damaged)) == set(range(12)) - {2, 7}
    assert codec.decode(damaged) == data


def test_shards_of_another_object_are_ignored() -> None:
    codec = Codec()
    a, b = os.urandom(5000), os.urandom(5000)
    oid_a = new_object_id()
    sa, sb = codec.encode(oid_a, a), codec.encode(new_object_id(), b)
    mixed: list[Shard | None] = [sb[i] if i < 2 else sa[i] for i in range(12)]
    assert codec.decode(mixed, oid_a) == a
    mixed[2] = sb[2]
    with pytest.raises(TooFewShards):
        codec.decode(mixed, oid_a)


def test_valid_shards_that_disagree_on_lengths_raise_size_mismatch() -> None:
    codec = Codec()
    oid = new_object_id()
    short, long = codec.encode(oid, os.urandom(1000)), codec.encode(oid, os.urandom(2000))
    mixed: list[Shard | None] = [long[0], *short[1:]]
    with pytest.raises(ShardSizeMismatch):
        codec.decode(mixed)


def test_wrong_slot_count_raises() -> None:
    codec = Codec()
    shards = codec.encode(new_object_id(), b"abc")
    with pytest.raises(ShardCountMismatch):
        codec.decode(shards[:11])


def test_verify_catches_parity_that_does_not_match_data() -> None:
    codec = Codec()
    shards = codec.encode(new_object_id(), os.urandom(4000))
    forged = bytearray(shards[11].payload)
    forged[-1] ^= 1  # a wrong parity shard with a *valid* checksum: only verify can tell
    h = shards[11].header
    header = ShardHeader(
        h.codec,
        h.k,
        h.m,
        h.index,
        h.traffic_class,
        h.object_id,
        h.object_len,
        len(forged),
        checksum(bytes(forged)),
    )
    assert not codec.verify([*shards[:11], Shard(header, bytes(forged))])


@pytest.mark.parametrize(("k", "m"), [(4, 2), (6, 3), (2, 1)])
def test_other_geometries(k: int, m: int) -> None:
    codec = Codec(CodecConfig(k=k, m=m))
    data = os.urandom(7777)
    shards = codec.encode(new_object_id(), data)
    holed: list[Shard | None] = list(shards)
    for i in random.Random(k).sample(range(k + m), m):
        holed[i] = None
    assert codec.decode(holed) == data


def test_config_validation_is_actionable() -> None:
    with pytest.raises(ValueError, match="known: .*isa_l_rs_cauchy"):
        CodecConfig(backend="nope")
    with pytest.raises(ValueError, match="1 <= k"):
        CodecConfig(k=0)
    with pytest.raises(ValueError, match="object id"):
        Codec().encode(b"short", b"x")


@pytest.mark.parametrize("backend", ["isal_cauchy", "isa_l_rs_cauchy", "zfec"])
@pytest.mark.parametrize("size", [4095, 4096, 4097, 8192, 8193, 3 * 4096 + 7, 40_961])
def test_striped_objects_round_trip_lose_two_and_rebuild_identically(backend: str, size: int) -> None:
    codec = Codec(CodecConfig(backend=backend, stripe_bytes=4096))
    data = os.urandom(size)
    shards = codec.encode(new_object_id(), data)
    assert shards[0].header.stripes == max(1, -(-size // 4096))
    assert codec.verify(shards)
    holed: list[Shard | None] = [None if i in (0, 7) else s for i, s in enumerate(shards)]
    holed[3] = _flip(shards[3], 5) if size > 4096 else holed[3]
    if size > 4096:
        holed[7] = shards[7]  # two losses in all: a corrupt shard and a missing one
    assert codec.decode(holed) == data
    assert [s.to_bytes() for s in codec.reconstruct(holed)] == [s.to_bytes() for s in shards]


def test_striping_is_off_with_zero() -> None:
    codec = Codec(CodecConfig(stripe_bytes=0))
    assert codec.encode(new_object_id(), os.urandom(3 << 20))[0].header.stripes == 1
    with pytest.raises(ValueError, match="stripe_bytes"):
        CodecConfig(stripe_bytes=100)


def test_skipping_checksums_still_checks_identity_and_length() -> None:
    codec = Codec()
    oid, data = new_object_id(), os.urandom(20_000)
    shards = codec.encode(oid, data)
    assert codec.decode(shards, oid, checksums=False) == data
    short = Shard(shards[0].header, shards[0].payload[:-1])
    assert 0 not in codec.valid([short, *shards[1:]], oid, checksums=False)
    other = codec.encode(new_object_id(), data)
    assert 0 not in codec.valid([other[0], *shards[1:]], oid, checksums=False)


def _mutations(codec: Codec, rng: random.Random) -> list[Shard | None]:
    """One object's shards with a few random faults: shards missing, moved to another slot,
    from another object, with a payload flipped, cut or extended, or a header field off."""
    data = os.urandom(rng.choice([1, 999, 10_000, 65_537]))
    shards: list[Shard | None] = list(codec.encode(new_object_id(), data))
    other = codec.encode(new_object_id(), data)
    for _ in range(rng.randint(0, 3)):
        i = rng.randrange(len(shards))
        s = shards[i]
        if s is None:
            continue
        fault = rng.choice(["missing", "swap", "foreign", "flip", "cut", "extend", "header"])
        if fault == "missing":
            shards[i] = None
        elif fault == "swap":
            j = rng.randrange(len(shards))
            shards[i], shards[j] = shards[j], shards[i]
        elif fault == "foreign":
            shards[i] = other[i]
        elif fault == "flip" and s.payload:
            shards[i] = _flip(s, rng.randrange(len(s.payload)))
        elif fault == "cut":
            shards[i] = Shard(s.header, bytes(s.payload)[:-1])
        elif fault == "extend":
            shards[i] = Shard(s.header, bytes(s.payload) + b"\0")
        else:
            field = rng.choice(["codec", "k", "m", "object_len", "payload_len", "stripes"])
            shards[i] = Shard(s.header._replace(**{field: getattr(s.header, field) + 1}), s.payload)
    return shards


def test_the_one_pass_check_agrees_with_the_shard_by_shard_check() -> None:
    """``valid`` takes a one-pass path when every shard is good; whatever it accepts must be
    exactly what the shard-by-shard check accepts, on intact and on faulty shard sets."""
    codec, rng, fast_taken = Codec(CodecConfig()), random.Random(6), 0
    for _ in range(400):
        shards = _mutations(codec, rng)
        oid = next((s.header.object_id for s in shards if s is not None), None)
        for object_id in (None, oid, b"x" * 16):
            try:
                each = codec._valid_each(shards, object_id, True)
            except ShardSizeMismatch:
                assert codec._valid_fast(shards, object_id, True) is None
                continue
            fast = codec._valid_fast(shards, object_id, True)
            if fast is not None:
                fast_taken += 1
                assert fast == each
            assert codec.valid(shards, object_id) == each
    assert fast_taken > 100  # the intact sets (and those with shards only missing) take it
