"""ISA-L through ctypes (kvstore.isal) and the ``isal_cauchy`` codec backend, checked
against the pyeclib and zfec backends on the same objects."""

from __future__ import annotations

import itertools
import logging
import os

import pytest

from kvstore import isal
from kvstore.codec import Codec, CodecConfig, TooFewShards, new_object_id
from kvstore.shardfmt import Shard

pytest.importorskip("pyeclib")
K, M = 10, 2
# Shard-boundary sizes (multiples of k and of ISA-L's 64-byte vector width, +-1) and odd ones.
SIZES = [1, K - 1, K, K + 1, 64 * K - 1, 64 * K, 64 * K + 1, 4096 * K - 1, 4096 * K, 4096 * K + 1, 100_003]


def _flip(shard: Shard, pos: int) -> Shard:
    payload = bytearray(shard.payload)
    payload[pos % len(payload)] ^= 0x01
    return Shard(shard.header, bytes(payload))


def test_library_is_found_next_to_pyeclib_and_bad_paths_say_what_was_tried() -> None:
    first = isal.library_candidates()[0]
    assert os.path.basename(os.path.dirname(first)) == "pyeclib.libs" and "libisal" in first
    with pytest.raises(isal.IsalUnavailable, match="/nonexistent/libisal.so"):
        isal.load_library("/nonexistent/libisal.so")


def test_auto_prefers_isal_and_falls_back_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert CodecConfig().resolve().backend == "isal_cauchy"
    assert Codec().config.backend == "isal_cauchy"

    def missing() -> None:
        raise isal.IsalUnavailable("ISA-L not found (test)")

    monkeypatch.setattr(isal, "default_library", missing)
    with caplog.at_level(logging.WARNING, logger="kvstore.codec"):
        codec = Codec()
    assert codec.config.backend == "isa_l_rs_cauchy"
    assert "isal_cauchy: ISA-L not found (test)" in caplog.text
    data = os.urandom(5000)
    assert codec.decode(codec.encode(new_object_id(), data)) == data


@pytest.mark.parametrize("size", [K * 4096, 1 << 20, 12_345])
def test_payloads_are_byte_identical_to_pyeclib_isa_l_cauchy_fragment_bodies(size: int) -> None:
    """Same matrix, same split: each of our payloads equals pyeclib's fragment after its
    80-byte liberasurecode header, so pyeclib's ``isa_l_rs_cauchy`` decodes our bytes."""
    from pyeclib.ec_iface import ECDriver

    data = os.urandom(size)
    ours = isal.IsalCauchyBackend(K, M).encode(data)
    frags = ECDriver(k=K, m=M, ec_type="isa_l_rs_cauchy").encode(data)
    assert [bytes(p) for p in ours] == [f[80:] for f in frags]


@pytest.mark.parametrize("size", SIZES)
def test_every_two_missing_pattern_matches_pyeclib_and_zfec(size: int) -> None:
    data = os.urandom(size)
    codecs = {name: Codec(CodecConfig(backend=name)) for name in ("isal_cauchy", "isa_l_rs_cauchy", "zfec")}
    oid = new_object_id()
    shards = {name: c.encode(oid, data) for name, c in codecs.items()}
    for lost in itertools.combinations(range(K + M), 2):
        for name, codec in codecs.items():
            have: list[Shard | None] = list(shards[name])
            for i in lost:
                have[i] = None
            assert codec.decode(have, oid) == data, (name, lost)
        have = list(shards["isal_cauchy"])
        for i in lost:
            have[i] = None
        rebuilt = codecs["isal_cauchy"].reconstruct(have, oid)
        assert [bytes(s.payload) for s in rebuilt] == [bytes(s.payload) for s in shards["isal_cauchy"]]
        assert [s.header for s in rebuilt] == [s.header for s in shards["isal_cauchy"]]


@pytest.mark.parametrize("size", [0, 1, 2, 9, 10, 11, 63, 64, 65, 1000, 65_536, 1 << 20, (8 << 20) + 7])
def test_round_trip_and_one_data_shard_lost(size: int) -> None:
    codec = Codec(CodecConfig(backend="isal_cauchy"))
    data = os.urandom(size)
    shards: list[Shard | None] = list(codec.encode(new_object_id(), data))
    out = codec.decode(shards)
    assert type(out) is bytes and out == data
    assert codec.verify(shards)
    last = min(K - 1, max(0, (size - 1) // max(1, -(-size // K))))  # data shard holding the tail
    shards[last] = None
    assert codec.decode(shards) == data


def test_inputs_are_never_modified_and_data_shards_are_read_only_views() -> None:
    backend = isal.IsalCauchyBackend(K, M)
    data = bytearray(os.urandom(40_000))
    before = bytes(data)
    payloads = backend.encode(data)
    assert all(isinstance(p, memoryview) and p.readonly for p in payloads[:K])
    assert all(type(p) is bytes for p in payloads[K:])
    snapshot = [bytes(p) for p in payloads]
    got = backend.decode({i: payloads[i] for i in range(2, K + M)}, len(data))
    assert got == before and bytes(data) == before
    assert [bytes(p) for p in payloads] == snapshot


@pytest.mark.parametrize("bad", [(0,), (3, 11), (9, 10)])
def test_corrupt_shards_are_detected_and_decoded_around(bad: tuple[int, ...]) -> None:
    codec = Codec(CodecConfig(backend="isal_cauchy"))
    data, oid = os.urandom(200_001), new_object_id()
    shards: list[Shard | None] = list(codec.encode(oid, data))
    for i in bad:
        shard = shards[i]
        assert shard is not None
        shards[i] = _flip(shard, 12_345)
        assert not codec.shard_ok(shards[i], i, oid)  # type: ignore[arg-type]
    assert codec.decode(shards, oid) == data
    assert not codec.verify(shards)
    rebuilt = codec.reconstruct(shards, oid)
    assert codec.verify(rebuilt)


def test_three_corrupt_shards_raise_instead_of_decoding_wrong_bytes() -> None:
    codec = Codec(CodecConfig(backend="isal_cauchy"))
    shards: list[Shard | None] = list(codec.encode(new_object_id(), os.urandom(50_000)))
    for i in (1, 4, 10):
        shards[i] = _flip(shards[i], 7)  # type: ignore[arg-type]
    with pytest.raises(TooFewShards):
        codec.decode(shards)


@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 2), (6, 3), (12, 3)])
def test_other_geometries_every_m_missing(k: int, m: int) -> None:
    codec = Codec(CodecConfig(k=k, m=m, backend="isal_cauchy"))
    data = os.urandom(10_007)
    shards = codec.encode(new_object_id(), data)
    for lost in itertools.combinations(range(k + m), m):
        have: list[Shard | None] = [None if i in lost else s for i, s in enumerate(shards)]
        assert codec.decode(have) == data


def test_decode_tables_are_cached_per_pattern_and_bounded() -> None:
    code = isal.CauchyCode(K, M)
    present = tuple(range(2, K + 2))
    assert code.decode_tables(present, (0, 1)) is code.decode_tables(present, (0, 1))
    patterns = list(itertools.combinations(range(K + M), K))
    for p in patterns:
        code.decode_tables(p, tuple(i for i in range(K) if i not in p))
    assert code.decode_tables.cache_info().currsize == len(patterns) == 66

    class Small(isal.CauchyCode):
        MAX_PATTERNS = 10

    small = Small(K, M)
    for p in patterns:
        small.decode_tables(p, tuple(i for i in range(K + M) if i not in p))
    assert small.decode_tables.cache_info().currsize == 10
    with pytest.raises(ValueError, match="sorted distinct"):
        code.decode_rows((1, 0, *range(2, K)), (11,))


def test_addresses_of_every_buffer_kind_agree_with_the_buffer_protocol() -> None:
    import ctypes

    raw = os.urandom(100)
    for buf in (raw, memoryview(raw)[7:], bytearray(raw), memoryview(bytearray(raw))[3:]):
        assert ctypes.string_at(isal.address(buf), len(buf)) == bytes(buf)
    out, at = isal.new_bytes(16)
    ctypes.memmove(at, b"0123456789abcdef", 16)
    assert out == b"0123456789abcdef"
    with pytest.raises(BufferError, match="not C-contiguous"):
        isal.address(memoryview(raw)[::2])


def test_a_header_claiming_more_bytes_than_the_shards_hold_is_a_size_mismatch() -> None:
    from kvstore.codec import ShardSizeMismatch

    codec = Codec(CodecConfig(backend="isal_cauchy"))
    shards = codec.encode(new_object_id(), os.urandom(1000))
    lying = [Shard(s.header._replace(object_len=K * s.header.payload_len + 1), s.payload) for s in shards]
    with pytest.raises(ShardSizeMismatch, match="cannot fit"):
        codec.decode(lying)


@pytest.mark.parametrize("writer", ["isa_l_rs_cauchy", "zfec"])
def test_shards_of_another_backend_stay_readable(writer: str) -> None:
    """A store written before the default became isal_cauchy is still decoded, by the
    backend its headers name; rebuilt shards keep that backend's code and bytes."""
    old, new = Codec(CodecConfig(backend=writer)), Codec()
    assert new.config.backend == "isal_cauchy"
    data, oid = os.urandom(77_777), new_object_id()
    shards = old.encode(oid, data)
    have: list[Shard | None] = list(shards)
    have[0] = have[10] = None
    assert new.decode(have, oid) == data
    rebuilt = new.reconstruct(have, oid)
    assert [s.header for s in rebuilt] == [s.header for s in shards]
    assert [bytes(s.payload) for s in rebuilt] == [bytes(s.payload) for s in shards]
    assert new.verify(shards)


def test_mixed_or_unknown_backend_codes_are_not_decoded_together() -> None:
    from kvstore.codec import ShardSizeMismatch

    oid, data = new_object_id(), os.urandom(5000)
    a = Codec(CodecConfig(backend="isal_cauchy")).encode(oid, data)
    b = Codec(CodecConfig(backend="zfec")).encode(oid, data)
    codec = Codec()
    with pytest.raises(ShardSizeMismatch, match="codec"):
        codec.decode(a[:6] + b[6:])
    unknown = Shard(a[3].header._replace(codec=99), a[3].payload)
    assert not codec.shard_ok(unknown, 3) and codec.shard_ok(a[3], 3)


def test_shards_longer_than_one_isal_call_are_coded_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """ec_encode_data takes an int length; long shards go through it in slices."""
    data = os.urandom(100_003)
    whole = [bytes(p) for p in isal.IsalCauchyBackend(K, M).encode(data)]
    monkeypatch.setattr(isal, "_MAX_CALL_BYTES", 999)
    backend = isal.IsalCauchyBackend(K, M)
    sliced = backend.encode(data)
    assert [bytes(p) for p in sliced] == whole
    assert backend.decode({i: whole[i] for i in range(2, K + M)}, len(data)) == data
    assert backend.rebuild({i: whole[i] for i in range(2, K + M)}, [0, 1], len(data)) == {
        0: whole[0],
        1: whole[1],
    }
