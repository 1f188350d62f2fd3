"""Erasure-coding backends: the Galois-field engines behind ``kvstore.codec.Codec``.

Each backend is registered under a name and a code (the code is stored in every shard
header, so shards stay decodable by the backend that wrote them). ``isal_cauchy`` calls
ISA-L through ctypes (``kvstore.isal``, zero-copy); ``isa_l_rs_cauchy``, ``isa_l_rs_vand``
and ``liberasurecode_rs_vand`` go through pyeclib; ``zfec`` is zfec. ``AUTO_ORDER`` is what
``backend="auto"`` tries, fastest first. Pure: no sockets, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvstore.shardfmt import Payload


class ErasureBackend(Protocol):
    """The Galois-field engine behind a Codec.

    ``encode`` returns k+m payloads of equal length (they may be views of ``data``).
    ``decode`` receives at least k payloads keyed by shard index and returns the first
    ``object_len`` bytes of the object as new ``bytes``. ``rebuild`` returns the payloads
    of ``missing`` indices. Inputs are never modified. Callers guarantee that every payload
    passed in is an untampered encoder output. A factory raises (ImportError, OSError or
    RuntimeError) when its library is not available in this process.
    """

    def encode(self, data: Payload) -> list[Payload]: ...

    def decode(self, payloads: dict[int, Payload], object_len: int) -> bytes: ...

    def rebuild(
        self, payloads: dict[int, Payload], missing: list[int], object_len: int
    ) -> dict[int, Payload]: ...


BackendFactory = Callable[[int, int], ErasureBackend]
BACKENDS: dict[str, tuple[int, BackendFactory]] = {}
"""Registered backends: name -> (header code, factory). Written only by ``register_backend``."""


def register_backend(name: str, code: int) -> Callable[[BackendFactory], BackendFactory]:
    """Register a backend factory under ``name``; ``code`` is stored in every shard header."""

    def deco(factory: BackendFactory) -> BackendFactory:
        if name in BACKENDS or any(c == code for c, _ in BACKENDS.values()):
            raise ValueError(f"codec backend {name!r} or code {code} registered twice")
        BACKENDS[name] = (code, factory)
        return factory

    return deco


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def name_for_code(code: int) -> str | None:
    """The backend registered under header code ``code`` (None when none is)."""
    return next((name for name, (c, _) in BACKENDS.items() if c == code), None)


class _PyECLib:
    def __init__(self, k: int, m: int, ec_type: str) -> None:
        from pyeclib.ec_iface import ECDriver

        self._driver = ECDriver(k=k, m=m, ec_type=ec_type)

    def encode(self, data: Payload) -> list[Payload]:
        return list(self._driver.encode(bytes(data)))

    def decode(self, payloads: dict[int, Payload], object_len: int) -> bytes:
        # pyeclib aborts the process on memoryviews: hand it bytes only.
        return bytes(self._driver.decode([bytes(payloads[i]) for i in sorted(payloads)]))

    def rebuild(
        self, payloads: dict[int, Payload], missing: list[int], object_len: int
    ) -> dict[int, Payload]:
        frags = [bytes(payloads[i]) for i in sorted(payloads)]
        return dict(zip(missing, self._driver.reconstruct(frags, list(missing))))


def _pyeclib_factory(ec_type: str) -> BackendFactory:
    return lambda k, m: _PyECLib(k, m, ec_type)


for _code, _name in enumerate(("isa_l_rs_cauchy", "isa_l_rs_vand", "liberasurecode_rs_vand"), start=1):
    register_backend(_name, _code)(_pyeclib_factory(_name))


@register_backend("isal_cauchy", 4)
def _isal_cauchy(k: int, m: int) -> ErasureBackend:
    from kvstore.isal import IsalCauchyBackend

    return IsalCauchyBackend(k, m)


AUTO = "auto"
# What ``backend="auto"`` tries, in order (fastest first, as measured in docs/kvstore.md).
AUTO_ORDER = ("isal_cauchy", "isa_l_rs_cauchy", "zfec")


@register_backend("zfec", 16)
class _Zfec:
    def __init__(self, k: int, m: int) -> None:
        import zfec

        self.k, self.n = k, k + m
        self._enc = zfec.Encoder(k, self.n)
        self._dec = zfec.Decoder(k, self.n)

    def encode(self, data: Payload) -> list[Payload]:
        size = max(1, -(-len(data) // self.k))
        padded = bytes(data) + bytes(size * self.k - len(data))
        blocks = [padded[i * size : (i + 1) * size] for i in range(self.k)]
        return [bytes(b) for b in self._enc.encode(blocks, list(range(self.n)))]

    def decode(self, payloads: dict[int, Payload], object_len: int) -> bytes:
        nums = sorted(payloads)[: self.k]
        blocks = self._dec.decode([payloads[i] for i in nums], nums)
        return b"".join(bytes(b) for b in blocks)[:object_len]

    def rebuild(
        self, payloads: dict[int, Payload], missing: list[int], object_len: int
    ) -> dict[int, Payload]:
        full = self.encode(self.decode(payloads, object_len))
        return {i: full[i] for i in missing}
