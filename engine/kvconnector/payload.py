"""The versioned, self-describing byte format of KV-cache payloads (never pickle).

A payload is one binary header followed by its section bodies back to back. All integers
are little-endian. Byte layout (offsets in bytes; n = sections, M = metadata length)::

     0          magic          4s   b"SLKV"
     4          version        u16  FORMAT_VERSION (1)
     6          kind           u8   KIND_BLOCK 1, KIND_SLOT 2, KIND_SEQUENCE 3, KIND_EMBEDDING 4
     7          dtype          u8   DTYPE_CODES: float32 1, bfloat16 2, float16 3
     8          fingerprint    16s  first 16 bytes of the engine's sha256 model fingerprint
    24          layout         8s   layout_digest(spec, dtype)
    32          n_sections     u32  n
    36          meta_len       u32  M (0 = no metadata; at most MAX_META_BYTES)
    40          section table  n x (u64 nbytes, u64 xxh3_64 of the body)
    40+16n      metadata       M bytes of UTF-8 JSON (a JSON object)
    40+16n+M    header_xxh3    u64  xxh3_64 of bytes [0, 40+16n+M)
    48+16n+M    bodies         section 0, section 1, ... (sum of nbytes)

A block payload (one concatenated section, no metadata) has a 64-byte header
(``HEADER_BYTES_BLOCK``). Section bodies are the raw bytes of CPU-contiguous tensors, in the
order ``CompressedPool.block_tensors`` / ``SWASlots.slot_tensors`` define.

Reserved metadata keys (extensible fields; v1 readers ignore keys they do not know):

- ``image_hashes``: list of hex strings, the content hashes of images whose vision tokens
  the payload's positions cover (a prefix with images only matches the same images);
- ``host_slot``: a JSON object describing a slot kept in the host SWA cache;
- ``format``: how a slot's body is stored: ``"native"`` (the default: the tensors' bytes) or
  ``"mxfp8"`` (``caches.pack_slot``; lossy). A reader refuses a format it does not know;
- ``layers``: a slot that keeps only its first N layers (an int; absent: every layer). An
  older reader that ignores it refuses the body on its size.

`decode` refuses, with a `PayloadError` naming what was expected and what was found: a
wrong magic, another format version, a truncated header or body, trailing bytes, a header
or section checksum mismatch, another kind, dtype, model fingerprint or cache layout, and
malformed metadata. ``engine/kvconnector/caches.py`` packs pool blocks and SWA slots into
this format, and verifies all of that, and the body size, before writing a single byte into
a cache.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import xxhash

from engine.cache.spec import CacheSpec
from engine.config import BLOCK_TOKENS, CSA

MAGIC = b"SLKV"
FORMAT_VERSION = 1
#: Bump when the meaning of the tensor order or geometry changes without a field changing.
LAYOUT_VERSION = 1

KIND_BLOCK = 1
KIND_SLOT = 2
KIND_SEQUENCE = 3
#: A vision encoder's rows for one image (``engine.vision.stage.RowsFormat``): one section
#: of [length, hidden] rows; fingerprint and layout name the encoder, not the KV cache.
KIND_EMBEDDING = 4
KIND_NAMES: Mapping[int, str] = MappingProxyType(
    {KIND_BLOCK: "block", KIND_SLOT: "slot", KIND_SEQUENCE: "sequence", KIND_EMBEDDING: "embedding"}
)

#: dtype -> header code. Codes are part of the format: never renumber.
DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType(
    {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
)
DTYPE_NAMES: Mapping[int, str] = MappingProxyType({1: "float32", 2: "bfloat16", 3: "float16"})

FINGERPRINT_LEN = 16
DIGEST_LEN = 8
MAX_META_BYTES = 1 << 20
RESERVED_META_KEYS = ("image_hashes", "host_slot")

_FIXED = struct.Struct("<4sHBB16s8sII")  # 40 bytes: magic .. meta_len
_SECTION = struct.Struct("<QQ")  # 16 bytes: nbytes, xxh3_64
_CHECK = struct.Struct("<Q")  # 8 bytes: header xxh3_64

checksum: Callable[[bytes | memoryview], int] = xxhash.xxh3_64_intdigest


def header_bytes(num_sections: int, meta_len: int = 0) -> int:
    """Exact header size of a payload with ``num_sections`` sections and ``meta_len`` metadata bytes."""
    return _FIXED.size + num_sections * _SECTION.size + meta_len + _CHECK.size


HEADER_BYTES_BLOCK = header_bytes(1, 0)


class PayloadError(ValueError):
    """The bytes are not a payload this engine may accept; the message says expected vs found."""


class Decoded(NamedTuple):
    """A verified payload: its metadata (``{}`` when none) and zero-copy views of its sections."""

    meta: dict[str, Any]
    sections: list[memoryview]


class _Header(NamedTuple):
    kind: int
    dtype_code: int
    fingerprint: bytes
    digest: bytes
    table: list[tuple[int, int]]  # (nbytes, xxh3) per section
    meta: memoryview
    size: int  # header bytes, checksum included


# ------------------------------------------------------------------ identity helpers
def layout_digest(spec: CacheSpec, dtype: torch.dtype) -> bytes:
    """8 bytes of sha256 over a canonical JSON description of the cache layout: layer types,
    head dims, window, rates, rows per block, state windows, block tokens, dtype and
    ``LAYOUT_VERSION``. Two engines whose pools or slots differ in any of them get different
    digests. ``spec.elem_bytes``/``state_bytes`` are not part of it: ``dtype`` is what the
    tensors hold. Raises PayloadError for a dtype with no payload code."""
    _dtype_code(dtype)
    n = len(spec.layer_types)
    desc = {
        "layout_version": LAYOUT_VERSION,
        "block_tokens": BLOCK_TOKENS,
        "layer_types": list(spec.layer_types),
        "head_dim": spec.head_dim,
        "index_head_dim": spec.index_head_dim,
        "window": spec.window,
        "csa_rate": spec.csa_rate,
        "hca_rate": spec.hca_rate,
        "rows_per_block": [spec.rows_per_block(i) if spec.rate(i) else 0 for i in range(n)],
        "state_windows": [spec.state_window(i) for i in range(n)],
        "dtype": DTYPE_NAMES[DTYPE_CODES[dtype]],
    }
    canon = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).digest()[:DIGEST_LEN]


def block_body_bytes(spec: CacheSpec, dtype: torch.dtype) -> int:
    """Bytes of one physical block's tensors (all compressed layers, rows and index rows)."""
    elems = 0
    for layer, t in enumerate(spec.layer_types):
        if spec.rate(layer) == 0:
            continue
        width = spec.head_dim + (spec.index_head_dim if t == CSA else 0)
        elems += spec.rows_per_block(layer) * width
    return elems * _itemsize(dtype)


def block_payload_bytes(spec: CacheSpec, dtype: torch.dtype) -> int:
    """Total bytes of a ``pack_block`` payload: ``HEADER_BYTES_BLOCK`` + the block body."""
    return HEADER_BYTES_BLOCK + block_body_bytes(spec, dtype)


def _itemsize(dtype: torch.dtype) -> int:
    _dtype_code(dtype)
    return torch.empty(0, dtype=dtype).element_size()


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        known = ", ".join(DTYPE_NAMES.values())
        raise PayloadError(f"dtype {dtype} has no payload code; supported: {known}") from None


def _fingerprint16(fingerprint: bytes) -> bytes:
    if not isinstance(fingerprint, bytes | bytearray) or len(fingerprint) < FINGERPRINT_LEN:
        raise PayloadError(
            f"model fingerprint must be >= {FINGERPRINT_LEN} bytes (the engine's sha256 digest: "
            f"bytes.fromhex(model_fingerprint(...))), got {fingerprint!r:.40}"
        )
    return bytes(fingerprint[:FINGERPRINT_LEN])


def _digest8(digest: bytes) -> bytes:
    if not isinstance(digest, bytes | bytearray) or len(digest) != DIGEST_LEN:
        raise PayloadError(f"layout digest must be {DIGEST_LEN} bytes (layout_digest()), got {digest!r:.40}")
    return bytes(digest)


def _short(b: bytes) -> str:
    return b.hex()[:12] + "..."


def _kind_name(kind: int) -> str:
    return f"{kind} ({KIND_NAMES.get(kind, 'unknown')})"


# ------------------------------------------------------------------ metadata
def _check_meta(meta: Mapping[str, Any]) -> None:
    """Keys are strings; reserved keys have their documented types. Raises PayloadError."""
    bad = [k for k in meta if not isinstance(k, str)]
    if bad:
        raise PayloadError(f"metadata keys must be strings, got {bad[:3]!r}")
    hashes = meta.get("image_hashes")
    if hashes is not None and not (
        isinstance(hashes, list) and all(isinstance(h, str) and _is_hex(h) for h in hashes)
    ):
        raise PayloadError("metadata 'image_hashes' must be a list of hex strings")
    host = meta.get("host_slot")
    if host is not None and not isinstance(host, dict):
        raise PayloadError(f"metadata 'host_slot' must be a JSON object, got {type(host).__name__}")
    fmt = meta.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise PayloadError(f"metadata 'format' must be a string, got {type(fmt).__name__}")
    layers = meta.get("layers")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise PayloadError(f"metadata 'layers' must be a positive int, got {layers!r}")


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True


def _encode_meta(meta: Mapping[str, Any] | None) -> bytes:
    if not meta:
        return b""
    _check_meta(meta)
    try:
        blob = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise PayloadError(f"metadata is not plain JSON: {e}") from None
    raw = blob.encode("utf-8")
    if len(raw) > MAX_META_BYTES:
        raise PayloadError(f"metadata is {len(raw)} bytes, the limit is {MAX_META_BYTES}")
    return raw


def _decode_meta(raw: memoryview) -> dict[str, Any]:
    if len(raw) == 0:
        return {}
    try:
        meta = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PayloadError(f"metadata is not UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        raise PayloadError(f"metadata must be a JSON object, found {type(meta).__name__}")
    _check_meta(meta)
    return meta


# ------------------------------------------------------------------ encode / decode
def _as_bytes(section: bytes | bytearray | memoryview | torch.Tensor) -> memoryview:
    """A flat byte view of one section; tensors go through CPU-contiguous raw bytes."""
    if isinstance(section, torch.Tensor):
        flat = section.detach().contiguous().cpu().reshape(-1)  # [numel] of any dtype
        return flat.view(torch.uint8).numpy().data  # [nbytes] bytes; bf16 safe (no numpy bf16)
    return memoryview(section).cast("B")


def encode(
    kind: int,
    fingerprint: bytes,
    digest: bytes,
    dtype: torch.dtype,
    sections: Sequence[bytes | bytearray | memoryview | torch.Tensor],
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """One payload: header (with per-section length and xxh3, metadata, header checksum)
    then the section bodies. Raises PayloadError for an unknown kind or dtype, a
    fingerprint shorter than 16 bytes, a digest that is not 8 bytes, or bad metadata."""
    if kind not in KIND_NAMES:
        raise PayloadError(f"unknown payload kind {kind}; known: {dict(KIND_NAMES)}")
    bodies = [_as_bytes(s) for s in sections]
    meta_raw = _encode_meta(meta)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        kind,
        _dtype_code(dtype),
        _fingerprint16(fingerprint),
        _digest8(digest),
        len(bodies),
        len(meta_raw),
    )
    table = b"".join(_SECTION.pack(b.nbytes, checksum(b)) for b in bodies)
    head = fixed + table + meta_raw
    return b"".join([head, _CHECK.pack(checksum(head)), *bodies])


def _parse_header(mv: memoryview) -> _Header:
    """Magic, version, header length and header checksum (in that order)."""
    if bytes(mv[:4]) != MAGIC[: len(mv)]:
        raise PayloadError(f"not a Sluice KV payload (magic {bytes(mv[:4])!r}, expected {MAGIC!r})")
    if len(mv) < _FIXED.size:
        raise PayloadError(f"truncated: a payload header is at least {_FIXED.size} bytes, got {len(mv)}")
    _magic, version, kind, dcode, fp, dg, n_sections, meta_len = _FIXED.unpack_from(mv)
    if version != FORMAT_VERSION:
        raise PayloadError(f"payload format version {version}, this engine reads {FORMAT_VERSION}")
    if meta_len > MAX_META_BYTES:
        raise PayloadError(f"metadata length {meta_len} exceeds the {MAX_META_BYTES}-byte limit")
    size = header_bytes(n_sections, meta_len)
    if len(mv) < size:
        raise PayloadError(f"truncated: header says {size} header bytes, got {len(mv)}")
    (stored,) = _CHECK.unpack_from(mv, size - _CHECK.size)
    if checksum(mv[: size - _CHECK.size]) != stored:
        raise PayloadError("header checksum mismatch (the header is corrupt)")
    table = [_SECTION.unpack_from(mv, _FIXED.size + i * _SECTION.size) for i in range(n_sections)]
    meta_at = _FIXED.size + n_sections * _SECTION.size
    return _Header(kind, dcode, fp, dg, table, mv[meta_at : meta_at + meta_len], size)


def _check_identity(h: _Header, kind: int, fingerprint: bytes, digest: bytes, dtype: torch.dtype) -> None:
    """Kind, dtype, model fingerprint and layout digest must all be the caller's."""
    if h.kind != kind:
        raise PayloadError(f"payload kind {_kind_name(h.kind)}, expected {_kind_name(kind)}")
    want = _dtype_code(dtype)
    if h.dtype_code != want:
        found = DTYPE_NAMES.get(h.dtype_code, f"unknown code {h.dtype_code}")
        raise PayloadError(f"payload dtype {found}, this engine's cache is {DTYPE_NAMES[want]}")
    fp = _fingerprint16(fingerprint)
    if h.fingerprint != fp:
        raise PayloadError(
            f"model fingerprint mismatch (payload {_short(h.fingerprint)}, engine {_short(fp)})"
        )
    dg = _digest8(digest)
    if h.digest != dg:
        raise PayloadError(
            f"cache layout mismatch (payload {h.digest.hex()}, engine {dg.hex()}): "
            "the sender's layer types, dims, window, rates or dtype differ"
        )


def _split_sections(mv: memoryview, h: _Header) -> list[memoryview]:
    """Exact body length (no truncation, no trailing bytes), then every section checksum."""
    body_len = sum(n for n, _ in h.table)
    got = len(mv) - h.size
    if got < body_len:
        raise PayloadError(f"truncated: header says {body_len} body bytes, got {got}")
    if got > body_len:
        raise PayloadError(f"trailing bytes: header says {body_len} body bytes, got {got}")
    out: list[memoryview] = []
    off = h.size
    for i, (n, xxh) in enumerate(h.table):
        sec = mv[off : off + n]
        if checksum(sec) != xxh:
            raise PayloadError(f"checksum mismatch in section {i}")
        out.append(sec)
        off += n
    return out


def decode(
    buf: bytes | bytearray | memoryview, *, kind: int, fingerprint: bytes, digest: bytes, dtype: torch.dtype
) -> Decoded:
    """Verify and split a payload. Checks, in order: magic, format version, header length,
    header checksum, kind, dtype, model fingerprint (first 16 bytes), layout digest, exact
    body length, every section checksum, metadata (UTF-8 JSON object, reserved key types).
    Raises PayloadError on the first failure. Sections are views of ``buf`` (no copy)."""
    mv = memoryview(buf).cast("B")
    h = _parse_header(mv)
    _check_identity(h, kind, fingerprint, digest, dtype)
    sections = _split_sections(mv, h)
    return Decoded(_decode_meta(h.meta), sections)
