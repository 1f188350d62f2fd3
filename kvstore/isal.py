"""Reed-Solomon over GF(2^8) by calling Intel ISA-L directly through ctypes.

pyeclib's wheel bundles ISA-L (``pyeclib.libs/libisal-pyeclib.so.*``); going through
pyeclib's Python API costs two copies of every byte (into its aligned fragments and back
out as ``bytes``) plus an 80-byte header per fragment. Here the library is driven with
pointers into the caller's buffers, so the data shards of an encode are never copied and a
decode writes the recovered shards straight into the output.

The code is systematic with ISA-L's Cauchy matrix (``gf_gen_cauchy1_matrix``, the matrix
of pyeclib's ``isa_l_rs_cauchy``): every k x k submatrix is invertible, so any k of the
k+m shards decode. Pure: ctypes only; no sockets.

Buffer ownership: ``IsalCauchyBackend.encode`` returns the data shards as read-only
``memoryview`` slices of the caller's object (only a data shard that runs past the end of
the object is a padded copy) and the parity shards as new ``bytes``; ``decode`` returns a
new ``bytes`` object. Both new ``bytes`` are created uninitialised through the C API
(``PyBytes_FromStringAndSize(NULL, n)``) and filled by ISA-L before any other code sees
them, the documented way C code builds a bytes object; it saves zeroing the buffer.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

_U8P = ctypes.POINTER(ctypes.c_ubyte)
_PTRS = ctypes.POINTER(ctypes.c_void_p)


class IsalUnavailable(RuntimeError):
    """The ISA-L shared library could not be found or lacks a needed symbol."""


def library_candidates() -> list[str]:
    """Paths where ISA-L may live, most specific first: the copy bundled in the installed
    pyeclib wheel (``pyeclib.libs`` next to the package, found without importing pyeclib),
    then a system ``libisal``."""
    out: list[str] = []
    spec = importlib.util.find_spec("pyeclib")
    for pkg in (spec.submodule_search_locations or []) if spec else []:
        out += sorted(glob.glob(os.path.join(os.path.dirname(pkg), "pyeclib.libs", "libisal*.so*")))
    out += ["libisal.so.2", "libisal.so"]
    return out


def load_library(path: str | None = None) -> ctypes.CDLL:
    """Open ISA-L (``path``, or the first of ``library_candidates()`` that loads) and declare
    the prototypes used here; raises IsalUnavailable listing what was tried."""
    tried = [path] if path else library_candidates()
    errors = []
    for cand in tried:
        try:
            lib = ctypes.CDLL(cand)
        except OSError as exc:
            errors.append(f"{cand}: {exc}")
            continue
        try:
            _declare(lib)
        except AttributeError as exc:
            errors.append(f"{cand}: {exc}")
            continue
        return lib
    raise IsalUnavailable("ISA-L not found; tried " + "; ".join(errors))


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_u8p = ctypes.c_int, _U8P
    lib.gf_gen_cauchy1_matrix.argtypes = [c_u8p, c_int, c_int]
    lib.gf_gen_cauchy1_matrix.restype = None
    lib.gf_invert_matrix.argtypes = [c_u8p, c_u8p, c_int]
    lib.gf_invert_matrix.restype = c_int
    lib.gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
    lib.gf_mul.restype = ctypes.c_ubyte
    lib.ec_init_tables.argtypes = [c_int, c_int, c_u8p, c_u8p]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [c_int, c_int, c_int, c_u8p, _PTRS, _PTRS]
    lib.ec_encode_data.restype = None


_DEFAULT: list[ctypes.CDLL] = []
_DEFAULT_LOCK = threading.Lock()


def default_library() -> ctypes.CDLL:
    """The process-wide ISA-L handle (loaded once; a shared library is process-wide anyway)."""
    with _DEFAULT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(load_library())
        return _DEFAULT[0]


class _PyBuffer(ctypes.Structure):  # Py_buffer, part of the stable ABI since 3.11
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_api = ctypes.pythonapi
_api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_api.PyObject_GetBuffer.restype = ctypes.c_int
_api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_api.PyBuffer_Release.restype = None
_api.PyBytes_FromStringAndSize.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_api.PyBytes_FromStringAndSize.restype = ctypes.py_object
_PYBUF_SIMPLE = 0  # a plain pointer: exporters refuse it unless the buffer is contiguous
# In CPython a bytes object's data sits at a fixed offset from the object (ob_sval); checked
# once here against the buffer protocol, else every address goes through the protocol.
_BYTES_DATA = bytes.__basicsize__ - 1
_probe = b"probe-of-the-bytes-layout"


def _buffer_address(buf: Any) -> int:
    view = _PyBuffer()
    _api.PyObject_GetBuffer(buf, ctypes.byref(view), _PYBUF_SIMPLE)  # raises BufferError
    try:
        return int(view.buf)
    finally:
        _api.PyBuffer_Release(ctypes.byref(view))


_FAST_BYTES = sys.implementation.name == "cpython" and _buffer_address(_probe) == id(_probe) + _BYTES_DATA


def address(buf: Any) -> int:
    """Address of the first byte of a C-contiguous buffer (``bytes``, ``bytearray``,
    ``memoryview``, read-only ones included). The caller keeps ``buf`` alive while the
    address is in use."""
    if _FAST_BYTES and type(buf) is bytes:
        return id(buf) + _BYTES_DATA
    return _buffer_address(buf)


def new_bytes(n: int) -> tuple[bytes, int]:
    """A new, uninitialised ``bytes`` of length ``n`` and its address, to be filled before
    it is handed to anyone. ``n == 0`` gives the shared empty ``bytes`` (nothing to fill)."""
    if n == 0:
        return b"", 0
    out = _api.PyBytes_FromStringAndSize(None, n)  # n >= 1 with NULL: always a new object
    return out, address(out)


_MAX_CALL_BYTES = 1 << 30


class CauchyCode:
    """A systematic k+m Reed-Solomon code on ISA-L. Thread-safe: tables are immutable once
    built, and the decode tables are cached per erasure pattern by ``functools.lru_cache``.

    ``encode``/``decode`` take raw addresses; callers keep the buffers alive and make every
    buffer at least ``length`` bytes long. Sources are only read, destinations only written.
    """

    MAX_PATTERNS = 256  # decode tables kept (an erasure pattern is a few KiB of tables)

    def __init__(self, k: int, m: int, lib: ctypes.CDLL | None = None) -> None:
        if k < 1 or m < 1 or k + m > 255:
            raise ValueError(f"Cauchy code {k}+{m}: need k >= 1, m >= 1 and k+m <= 255")
        self.k, self.m, self.n = k, m, k + m
        self._lib = lib or default_library()
        matrix = (ctypes.c_ubyte * (self.n * k))()
        self._lib.gf_gen_cauchy1_matrix(matrix, self.n, k)
        self.matrix = bytes(matrix)  # n rows of k coefficients; the first k rows are identity
        self._encode_tables = self._tables(self.matrix[k * k :], m)
        # ISA-L tables that map shards ``present`` to shards ``want``, most recent patterns kept.
        self.decode_tables: Callable[[tuple[int, ...], tuple[int, ...]], Any] = functools.lru_cache(
            maxsize=self.MAX_PATTERNS
        )(lambda present, want: self._tables(self.decode_rows(present, want), len(want)))

    def _tables(self, rows: bytes, nrows: int) -> Any:
        tables = (ctypes.c_ubyte * (32 * self.k * nrows))()
        src = (ctypes.c_ubyte * len(rows)).from_buffer_copy(rows)
        self._lib.ec_init_tables(self.k, nrows, src, tables)
        return tables

    def encode(self, length: int, data: Sequence[int], parity: Sequence[int]) -> None:
        """Write the m parity shards (addresses ``parity``) of k data shards (``data``)."""
        self._run(length, self._encode_tables, data, parity)

    def decode(
        self, length: int, present: Sequence[int], src: Sequence[int], want: Sequence[int], dst: Sequence[int]
    ) -> None:
        """Write shards ``want`` (indices, to addresses ``dst``) from the k shards ``present``
        (sorted distinct indices, at addresses ``src``)."""
        tables = self.decode_tables(tuple(present), tuple(want))
        self._run(length, tables, src, dst)

    def _run(self, length: int, tables: Any, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != self.k:
            raise ValueError(f"need {self.k} source shards, got {len(src)}")
        if length <= 0 or not dst:
            return
        # ec_encode_data takes an int length: shards past 2 GiB go in slices.
        for off in range(0, length, _MAX_CALL_BYTES):
            srcs = (ctypes.c_void_p * self.k)(*(src if off == 0 else [a + off for a in src]))
            dsts = (ctypes.c_void_p * len(dst))(*(dst if off == 0 else [a + off for a in dst]))
            self._lib.ec_encode_data(min(_MAX_CALL_BYTES, length - off), self.k, len(dst), tables, srcs, dsts)

    def decode_rows(self, present: tuple[int, ...], want: tuple[int, ...]) -> bytes:
        """Coefficient rows expressing each wanted shard as a combination of ``present``."""
        k = self.k
        if len(present) != k or len(set(present)) != k or sorted(present) != list(present):
            raise ValueError(f"need {k} sorted distinct present shard indices, got {present}")
        if any(not 0 <= i < self.n for i in (*present, *want)):
            raise ValueError(f"shard index out of range for {k}+{self.m}: {present} -> {want}")
        sub = b"".join(self.matrix[i * k : (i + 1) * k] for i in present)
        inv = (ctypes.c_ubyte * (k * k))()
        if self._lib.gf_invert_matrix((ctypes.c_ubyte * (k * k)).from_buffer_copy(sub), inv, k) != 0:
            raise ValueError(f"shards {present} do not span the code")  # never for Cauchy
        inverse = bytes(inv)  # data shard j = sum_t inverse[j][t] * present[t]
        rows = bytearray()
        for w in want:
            coeffs = self.matrix[w * k : (w + 1) * k]  # shard w = sum_j coeffs[j] * data j
            for t in range(k):
                acc = 0
                for j in range(k):
                    acc ^= self._lib.gf_mul(coeffs[j], inverse[j * k + t])
                rows.append(acc)
        return bytes(rows)


class IsalCauchyBackend:
    """The codec backend: k data shards cut from the object (``size`` bytes each, the last
    zero-padded), m parity shards, all ``size`` bytes. See the module doc for ownership."""

    def __init__(self, k: int, m: int, lib: ctypes.CDLL | None = None) -> None:
        self.code = CauchyCode(k, m, lib)
        self.k, self.m, self.n = k, m, k + m

    def shard_size(self, object_len: int) -> int:
        return max(1, -(-object_len // self.k))

    def encode(self, data: Any) -> list[bytes | memoryview]:
        view = memoryview(data).cast("B").toreadonly()
        length, size = len(view), self.shard_size(len(view))
        base = address(view) if length else 0
        out: list[bytes | memoryview] = []
        src = []
        for i in range(self.k):
            start = i * size
            if start + size <= length:
                out.append(view[start : start + size])
                src.append(base + start)
            else:  # runs past the end of the object: a zero-padded copy
                take = max(0, length - start)
                padded, at = new_bytes(size)
                if take:
                    ctypes.memmove(at, base + start, take)
                ctypes.memset(at + take, 0, size - take)
                out.append(padded)
                src.append(at)
        parity = [new_bytes(size) for _ in range(self.m)]
        self.code.encode(size, src, [a for _, a in parity])
        return out + [p for p, _ in parity]

    def decode(self, payloads: dict[int, Any], object_len: int) -> bytes:
        use = sorted(payloads)[: self.k]
        if len(use) < self.k:
            raise ValueError(f"need {self.k} payloads, got {len(use)}")
        size = len(payloads[use[0]])
        if object_len > self.k * size:
            raise ValueError(f"object of {object_len} bytes does not fit {self.k} shards of {size}")
        out, base = new_bytes(object_len)
        want, dst, partial = [], [], []  # partial: (scratch, its address, bytes it holds, offset)
        for j in range(min(self.k, -(-object_len // size))):  # the data shards the object spans
            if j in payloads:
                continue
            start = j * size
            if start + size <= object_len:
                want.append(j)
                dst.append(base + start)
            else:  # the object ends inside this shard: recover it aside, copy its head
                scratch, at = new_bytes(size)
                want.append(j)
                dst.append(at)
                partial.append((scratch, at, object_len - start, start))
        if want:  # first: it reads every source, and the copies below then find them in cache
            self.code.decode(size, use, [address(payloads[i]) for i in use], want, dst)
        # a writable view of the new bytes: slice assignment copies without a ctypes call
        fill = memoryview((ctypes.c_char * object_len).from_address(base)).cast("B")
        for j in use:
            start = j * size
            if j >= self.k or start >= object_len:
                break  # sorted: parity and past-the-end shards follow
            take = min(size, object_len - start)
            fill[start : start + take] = payloads[j] if take == size else memoryview(payloads[j])[:take]
        for _scratch, at, take, start in partial:
            ctypes.memmove(base + start, at, take)
        return out

    def rebuild(
        self, payloads: dict[int, Any], missing: list[int], object_len: int
    ) -> dict[int, bytes | memoryview]:
        use = sorted(payloads)[: self.k]
        size = len(payloads[use[0]])
        fresh = {i: new_bytes(size) for i in missing}
        self.code.decode(
            size, use, [address(payloads[i]) for i in use], list(fresh), [a for _, a in fresh.values()]
        )
        out: dict[int, bytes | memoryview] = {i: b for i, (b, _) in fresh.items()}
        return out
