"""Codec part of ``sluice bench kvstore``: our codec against zfec, every pyeclib backend
that loads here, and a plain memory copy, on the same payloads in the same run.

Rows: ``sluice`` is ``kvstore.codec.Codec`` with its default (auto) backend, complete:
64-byte headers and an xxh3 checksum per shard on encode, every shard's header and
checksum checked on decode. ``sluice:<backend>`` are the same codec on other backends (the
previous default, for before/after). ``sluice_raw:isal_cauchy`` is the bare ctypes ISA-L
backend (no headers, no checksums), to show the cost of the shard format.
``sluice_read_path`` decodes as the store's read path does: every shard's header and xxh3
were checked when it arrived (overlapped with the network), so decode checks headers only;
its encode figure is the complete encode. The peers, the only rows the target compares
against, are ``zfec`` and ``pyeclib:<type>``: the libraries' own encode/decode, which
produce and check nothing of the kind. ``xxh3_GBps`` is the checksum pass alone over the
same bytes, the work the ``sluice`` decode does that the peers' does not.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.codec import Codec, CodecConfig, new_object_id
from kvstore.shardfmt import Shard, checksum

PYECLIB_TYPES = (
    "isa_l_rs_cauchy",
    "isa_l_rs_vand",
    "isa_l_rs_vand_inv",
    "liberasurecode_rs_vand",
    "jerasure_rs_vand",
    "jerasure_rs_cauchy",
)


def _pyeclib_pair(ec_type: str, k: int, m: int, data: bytes) -> tuple[Callable, Callable] | None:
    try:
        from pyeclib.ec_iface import ECDriver

        with warnings.catch_warnings():  # jerasure is deprecated in pyeclib; still a peer
            warnings.simplefilter("ignore", FutureWarning)
            driver = ECDriver(k=k, m=m, ec_type=ec_type)
        frags = driver.encode(data)
    except Exception:  # noqa: BLE001 - a backend that does not load here is skipped
        return None
    survivors = frags[2:]  # data shards 0 and 1 lost: a real decode
    if driver.decode(survivors) != data:
        raise RuntimeError(f"pyeclib {ec_type} decoded wrong bytes")
    return (lambda: driver.encode(data)), (lambda: driver.decode(survivors))


def _zfec_pair(k: int, m: int, data: bytes) -> tuple[Callable, Callable]:
    import zfec

    n = k + m
    enc, dec = zfec.Encoder(k, n), zfec.Decoder(k, n)
    size = -(-len(data) // k)
    padded = data + bytes(size * k - len(data))
    blocks = [padded[i * size : (i + 1) * size] for i in range(k)]
    coded = enc.encode(blocks, list(range(n)))
    nums = list(range(2, n))[:k]
    have = [coded[i] for i in nums]
    if b"".join(dec.decode(have, nums))[: len(data)] != data:
        raise RuntimeError("zfec decoded wrong bytes")
    return (lambda: enc.encode(blocks, list(range(n)))), (lambda: dec.decode(have, nums))


def _ours_pair(
    k: int, m: int, data: bytes, backend: str = "auto", checksums: bool = True
) -> tuple[Callable, Callable]:
    codec = Codec(CodecConfig(k=k, m=m, backend=backend))
    oid = new_object_id()
    # Decode gets what the read path hands it: one ``bytes`` per shard, as received.
    shards: list[Shard | None] = [Shard(s.header, bytes(s.payload)) for s in codec.encode(oid, data)]
    shards[0] = shards[1] = None
    if codec.decode(shards) != data:
        raise RuntimeError("sluice codec decoded wrong bytes")
    return (lambda: codec.encode(oid, data)), (lambda: codec.decode(shards, oid, checksums=checksums))


def _raw_isal_pair(k: int, m: int, data: bytes) -> tuple[Callable, Callable] | None:
    try:
        from kvstore.isal import IsalCauchyBackend

        backend = IsalCauchyBackend(k, m)
    except (ImportError, OSError, RuntimeError):
        return None
    payloads = backend.encode(data)
    survivors = {i: bytes(payloads[i]) for i in range(2, k + m)}
    if backend.decode(survivors, len(data)) != data:
        raise RuntimeError("raw ISA-L decoded wrong bytes")
    return (lambda: backend.encode(data)), (lambda: backend.decode(survivors, len(data)))


def peer_names(row: dict[str, Any]) -> list[str]:
    """The rows of one size that are peers (the libraries), not ours or the memcpy figure."""
    return [name for name in row if name == "zfec" or name.startswith("pyeclib:")]


def _pairs(k: int, m: int, data: bytes) -> dict[str, tuple[Callable, Callable]]:
    ours = _ours_pair(k, m, data)
    pairs: dict[str, tuple[Callable, Callable]] = {"sluice": ours}
    pairs["sluice_read_path"] = _ours_pair(k, m, data, checksums=False)
    if Codec(CodecConfig(k=k, m=m)).config.backend != "isa_l_rs_cauchy":
        pairs["sluice:isa_l_rs_cauchy"] = _ours_pair(k, m, data, "isa_l_rs_cauchy")
    raw = _raw_isal_pair(k, m, data)
    if raw is not None:
        pairs["sluice_raw:isal_cauchy"] = raw
    pairs["zfec"] = _zfec_pair(k, m, data)
    for ec_type in PYECLIB_TYPES:
        pair = _pyeclib_pair(ec_type, k, m, data)
        if pair is not None:
            pairs[f"pyeclib:{ec_type}"] = pair
    return pairs


def _rate_once(nbytes: int, fn: Callable[[], object], min_time_s: float) -> float:
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return reps * nbytes / elapsed / 1e9


def _hasher(data: bytes, k: int) -> Callable[[], object]:
    size = -(-len(data) // k)
    pieces = [memoryview(data)[i * size : (i + 1) * size] for i in range(k)]
    return lambda: [checksum(p) for p in pieces]


def _copier(data: bytes) -> Callable[[], object]:
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def run_codec(
    sizes: list[int], k: int, m: int, min_time_s: float, rounds: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """{size: {impl: {"encode_GBps", "decode2_GBps"}, "memcpy_GBps"}}.

    Rounds are interleaved across implementations (round r of every one, then round r+1),
    and the best round of each is kept, so a noisy moment on a shared machine does not
    favour whichever implementation happened to run in a quiet one.
    """
    out: dict[str, Any] = {}
    for size in sizes:
        data = os.urandom(size)
        pairs = _pairs(k, m, data)
        copy, hash_ = _copier(data), _hasher(data, k)
        row: dict[str, Any] = {name: {"encode_GBps": 0.0, "decode2_GBps": 0.0} for name in pairs}
        row["memcpy_GBps"] = row["xxh3_GBps"] = 0.0
        row["sluice_backend"] = Codec(CodecConfig(k=k, m=m)).config.backend
        for _ in range(rounds):
            for name, (enc, dec) in pairs.items():
                fig = row[name]
                fig["encode_GBps"] = max(fig["encode_GBps"], _rate_once(size, enc, min_time_s))
                fig["decode2_GBps"] = max(fig["decode2_GBps"], _rate_once(size, dec, min_time_s))
            row["memcpy_GBps"] = max(row["memcpy_GBps"], _rate_once(size, copy, min_time_s))
            row["xxh3_GBps"] = max(row["xxh3_GBps"], _rate_once(size, hash_, min_time_s))
        for name in pairs:
            log(
                f"codec {size >> 10} KiB {name}: enc {row[name]['encode_GBps']:.2f} dec2 {row[name]['decode2_GBps']:.2f} GB/s"
            )
        out[str(size)] = row
    return out
