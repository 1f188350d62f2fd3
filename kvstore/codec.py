"""Systematic Reed-Solomon erasure coding of objects into self-describing shards.

The API follows klauspost/reedsolomon: ``encode`` an object into k+m shards, ``verify``
a full set, ``reconstruct`` the missing ones (given as ``None``), ``decode`` the object.
Every shard carries a ``kvstore.shardfmt`` header; a shard that fails its checksum or does
not belong to the same object is treated as missing, so a wrong shard is never decoded.

The Galois-field work is done by a registered backend (``kvstore.backends``).
``backend="auto"`` (the default) resolves to the first that loads of ``isal_cauchy`` (ISA-L
called through ctypes, zero-copy, ``kvstore.isal``; fastest measured here),
``isa_l_rs_cauchy`` (the same library through pyeclib) and ``zfec``. Pure: no sockets, no
torch.

Buffer ownership: payloads are read-only buffers (``bytes`` or ``memoryview``). With
``isal_cauchy`` the data shards of ``encode`` are views of the object passed in, so that
object must not be mutated while its shards are in use (``bytes`` never is).
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice

from kvstore.backends import AUTO, AUTO_ORDER, BACKENDS, ErasureBackend, backend_names, name_for_code
from kvstore.shardfmt import OBJECT_ID_LEN, Payload, Shard, ShardHeader, checksum

__all__ = [
    "Codec", "CodecConfig", "CodecError", "TooFewShards", "ShardSizeMismatch", "ShardCountMismatch",
    "backend_names", "new_object_id",
]  # fmt: skip

log = logging.getLogger(__name__)

# The header fields every shard of one write shares: codec, k, m, object id, object length,
# payload length, stripes (ShardHeader's positions 0, 1, 2, 5, 6, 7, 9).
_COMMON = operator.itemgetter(0, 1, 2, 5, 6, 7, 9)


class CodecError(Exception):
    """Base class of every codec error."""


class TooFewShards(CodecError):
    """Fewer than k valid shards of one object are available; the object cannot be decoded."""

    def __init__(self, have: int, need: int, detail: str = "") -> None:
        self.have, self.need = have, need
        super().__init__(f"{have} valid shards, need {need} to decode" + (f": {detail}" if detail else ""))


class ShardSizeMismatch(CodecError):
    """Valid shards of one object disagree on their payload length or object length."""


class ShardCountMismatch(CodecError):
    """The shard list does not have exactly k+m entries."""


@dataclass(frozen=True)
class CodecConfig:
    """Erasure-code geometry and backend. Default 10+2 on ISA-L (Cauchy); ``"auto"`` is
    settled by ``resolve()``."""

    k: int = 10
    m: int = 2
    backend: str = AUTO
    # Objects larger than this are coded in stripes of about this size, each shard holding
    # its fragment of every stripe. Off by default: measured here, striping helps large
    # objects only in a process whose allocator returns big buffers to the kernel (then
    # every fresh buffer page-faults); with kvstore.memtune.tune_malloc() applied, as nodes
    # and the benchmark do, the extra copies make it a loss.
    stripe_bytes: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 32 or not 1 <= self.m <= 16:
            raise ValueError(f"erasure code {self.k}+{self.m}: need 1 <= k <= 32 and 1 <= m <= 16")
        if self.stripe_bytes != 0 and self.stripe_bytes < 4096:
            raise ValueError(f"stripe_bytes must be 0 (off) or at least 4096, got {self.stripe_bytes}")
        if self.backend != AUTO and self.backend not in BACKENDS:
            raise ValueError(f"unknown codec backend {self.backend!r}; known: {[AUTO, *backend_names()]}")

    def resolve(self) -> CodecConfig:
        """This config with ``backend`` settled: "auto" becomes the first of AUTO_ORDER whose
        library loads here (a fallback is logged). Raises CodecError when none loads."""
        if self.backend != AUTO:
            return self
        errors = []
        for name in AUTO_ORDER:
            try:
                BACKENDS[name][1](self.k, self.m)
            except (ImportError, OSError, RuntimeError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            if errors:
                log.warning("codec backend auto -> %s (unavailable here: %s)", name, "; ".join(errors))
            return replace(self, backend=name)
        raise CodecError("no erasure backend loads here: " + "; ".join(errors))

    @property
    def n(self) -> int:
        return self.k + self.m


def _stripe_payloads(use: dict[int, Shard], stripes: int) -> Iterator[dict[int, Payload]]:
    """Per stripe, the fragment of each shard in ``use`` (payload = stripes equal fragments);
    made one stripe at a time so the slices stay in cache."""
    size = next(iter(use.values())).header.payload_len // stripes
    for st in range(stripes):
        yield {i: s.payload[st * size : (st + 1) * size] for i, s in use.items()}


def new_object_id() -> bytes:
    """A fresh identity for one write of one object (random, never reused)."""
    return os.urandom(OBJECT_ID_LEN)


class Codec:
    """Encode objects into k+m checksummed shards and decode them back.

    Encoding uses the configured backend. Decoding uses the backend named by the shards'
    header code, when that backend loads here: shards written by another backend of the
    same k+m (say, before the default changed) stay readable."""

    def __init__(self, config: CodecConfig | None = None) -> None:
        self.config = (config or CodecConfig()).resolve()
        code, factory = BACKENDS[self.config.backend]
        self.code = code
        self._backend = factory(self.config.k, self.config.m)
        self._by_code: dict[int, ErasureBackend | None] = {code: self._backend}

    def backend_for(self, code: int) -> ErasureBackend | None:
        """The backend for shards of header code ``code``; None when it is unknown or its
        library does not load here (such shards count as missing)."""
        if code not in self._by_code:
            backend = None
            name = name_for_code(code)
            if name is not None:
                try:
                    backend = BACKENDS[name][1](self.config.k, self.config.m)
                except (ImportError, OSError, RuntimeError) as exc:
                    log.warning("shards of codec backend %s cannot be decoded here: %s", name, exc)
            self._by_code[code] = backend
        return self._by_code[code]

    def stripes_for(self, length: int) -> int:
        s = self.config.stripe_bytes
        return 1 if s == 0 or length <= s else min(65535, -(-length // s))

    def encode(self, object_id: bytes, data: Payload, traffic_class: int = 0) -> list[Shard]:
        """Split ``data`` into k data and m parity shards, each with its header. The header
        is kept apart from the payload (``Shard.header``/``Shard.payload``); nothing here
        concatenates them."""
        return self._encode(self._backend, self.code, object_id, data, traffic_class)

    def _encode(
        self, backend: ErasureBackend, code: int, object_id: bytes, data: Payload, traffic_class: int
    ) -> list[Shard]:
        if len(object_id) != OBJECT_ID_LEN:
            raise ValueError(f"object id must be {OBJECT_ID_LEN} bytes, got {len(object_id)}")
        cfg = self.config
        stripes = self.stripes_for(len(data))
        if stripes == 1:
            payloads = backend.encode(data)
        else:
            per = -(-len(data) // stripes)  # every stripe this long; the last one zero-padded
            view = memoryview(data)
            coded = []
            for i in range(stripes):
                piece = bytes(view[i * per : (i + 1) * per])
                coded.append(backend.encode(piece + bytes(per - len(piece))))
            payloads = [b"".join(c[j] for c in coded) for j in range(cfg.n)]
        return [
            Shard(
                ShardHeader(
                    code,
                    cfg.k,
                    cfg.m,
                    i,
                    traffic_class,
                    object_id,
                    len(data),
                    len(p),
                    checksum(p),
                    stripes,
                ),
                p,
            )
            for i, p in enumerate(payloads)
        ]

    def shard_ok(
        self, shard: Shard, index: int, object_id: bytes | None = None, *, checksums: bool = True
    ) -> bool:
        """True when ``shard`` is intact, of this k+m and of a backend that decodes here, at
        ``index`` and (if given) of ``object_id``. ``checksums=False`` skips the payload hash,
        for shards the caller has already checked with ``shard_ok``."""
        h, cfg = shard.header, self.config
        if (h.k, h.m, h.index) != (cfg.k, cfg.m, index):
            return False
        if h.codec != self.code and self.backend_for(h.codec) is None:
            return False
        if object_id is not None and h.object_id != object_id:
            return False
        payload = shard.payload
        if len(payload) != h.payload_len:
            return False
        # Shard.check inlined: this runs for every shard of every read
        return not checksums or checksum(payload) == h.payload_xxh3

    def valid(
        self, shards: Sequence[Shard | None], object_id: bytes | None = None, *, checksums: bool = True
    ) -> dict[int, Shard]:
        """The shards that pass their checksums and agree with this codec and each other.

        A shard that fails is dropped (treated as missing). Raises ShardCountMismatch for a
        list of the wrong length and ShardSizeMismatch when valid shards disagree on lengths.
        """
        cfg = self.config
        if len(shards) != cfg.n:
            raise ShardCountMismatch(f"expected {cfg.n} shard slots, got {len(shards)}")
        fast = self._valid_fast(shards, object_id, checksums)
        return fast if fast is not None else self._valid_each(shards, object_id, checksums)

    def _valid_each(
        self, shards: Sequence[Shard | None], object_id: bytes | None, checksums: bool
    ) -> dict[int, Shard]:
        """``valid``, one shard at a time: drops each bad shard, then checks the rest agree."""
        cfg = self.config
        ok = self.shard_ok
        good = {
            pos: shard
            for pos, shard in enumerate(shards)
            if shard is not None and ok(shard, pos, object_id, checksums=checksums)
        }
        lengths = {
            (h.object_id, h.codec, h.object_len, h.payload_len, h.stripes)
            for h in (s.header for s in good.values())
        }
        if len(lengths) > 1:
            raise ShardSizeMismatch(
                f"valid shards disagree on (object id, codec, lengths): {sorted(lengths)}"
            )
        for _oid, _code, object_len, payload_len, _stripes in lengths:
            if object_len > cfg.k * payload_len:
                raise ShardSizeMismatch(
                    f"{object_len}-byte object cannot fit {cfg.k} shards of {payload_len}"
                )
        return good

    def _valid_fast(
        self, shards: Sequence[Shard | None], object_id: bytes | None, checksums: bool
    ) -> dict[int, Shard] | None:
        """``valid`` for the usual case, in one pass: every given shard is intact, in its
        slot and of one write. None as soon as any is not; ``_valid_each`` then sorts the
        shards out one by one. This runs on every decode: a 1 MiB decode (2 missing) is ~6%
        faster with it (``scripts/ab_codec_decode.py``, docs/benchmarks.md)."""
        good: dict[int, Shard] = {}
        common = None
        for pos, shard in enumerate(shards):
            if shard is None:
                continue
            h = shard.header
            if common is None:
                common = _COMMON(h)
                codec, k, m, oid, object_len, payload_len, _stripes = common
                cfg = self.config
                if (k, m) != (cfg.k, cfg.m) or object_len > k * payload_len:
                    return None
                if (object_id is not None and oid != object_id) or (
                    codec != self.code and self.backend_for(codec) is None
                ):
                    return None
            elif _COMMON(h) != common:
                return None
            payload = shard.payload
            if h.index != pos or len(payload) != h.payload_len:
                return None
            if checksums and checksum(payload) != h.payload_xxh3:
                return None
            good[pos] = shard
        return good

    def _decoder(self, header: ShardHeader) -> ErasureBackend:
        backend = self.backend_for(header.codec)
        if backend is None:  # shard_ok admits no shard of such a code
            raise CodecError(f"no backend for codec code {header.codec}")
        return backend

    def verify(self, shards: Sequence[Shard | None]) -> bool:
        """True when all k+m shards are present, valid, and the parity matches the data."""
        good = self.valid(shards)
        if len(good) != self.config.n:
            return False
        h = good[0].header
        again = self._encode(self._decoder(h), h.codec, h.object_id, self.decode(shards), h.traffic_class)
        return all(again[i].payload == good[i].payload for i in range(self.config.n))

    def decode(
        self, shards: Sequence[Shard | None], object_id: bytes | None = None, *, checksums: bool = True
    ) -> bytes:
        """The object, from any k valid shards; raises TooFewShards otherwise.
        ``checksums=False``: every given shard already passed ``shard_ok`` (the read path)."""
        good = self.valid(shards, object_id, checksums=checksums)
        if len(good) < self.config.k:
            raise TooFewShards(len(good), self.config.k)
        ref = next(iter(good.values())).header
        backend = self._decoder(ref)
        use = dict(islice(good.items(), self.config.k))  # valid() keeps slot order
        if ref.stripes == 1:
            data = backend.decode({i: s.payload for i, s in use.items()}, ref.object_len)
        else:
            per = -(-ref.object_len // ref.stripes)
            parts = [backend.decode(payloads, per) for payloads in _stripe_payloads(use, ref.stripes)]
            parts[-1] = parts[-1][: ref.object_len - per * (ref.stripes - 1)]
            data = b"".join(parts)
        if len(data) != ref.object_len:
            raise ShardSizeMismatch(f"decoded {len(data)} bytes, header says {ref.object_len}")
        return data

    def reconstruct(self, shards: Sequence[Shard | None], object_id: bytes | None = None) -> list[Shard]:
        """All k+m shards: valid ones as given, missing or corrupt ones rebuilt."""
        good = self.valid(shards, object_id)
        if len(good) < self.config.k:
            raise TooFewShards(len(good), self.config.k)
        missing = [i for i in range(self.config.n) if i not in good]
        if not missing:
            return [good[i] for i in range(self.config.n)]
        ref = next(iter(good.values())).header
        backend = self._decoder(ref)
        use = dict(islice(good.items(), self.config.k))
        if ref.stripes == 1:
            rebuilt = backend.rebuild({i: s.payload for i, s in use.items()}, missing, ref.object_len)
        else:
            per = -(-ref.object_len // ref.stripes)
            pieces = [backend.rebuild(p, missing, per) for p in _stripe_payloads(use, ref.stripes)]
            rebuilt = {i: b"".join(p[i] for p in pieces) for i in missing}
        out = dict(good)
        for i, payload in rebuilt.items():
            header = ShardHeader(
                ref.codec, ref.k, ref.m, i, ref.traffic_class, ref.object_id, ref.object_len,
                len(payload), checksum(payload), ref.stripes,
            )  # fmt: skip
            out[i] = Shard(header, payload)
        return [out[i] for i in range(self.config.n)]
