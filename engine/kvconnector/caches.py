"""Pool blocks and SWA slots in and out of the KV payload format (``payload.py``).

A block or slot payload has one section: the raw bytes of ``CompressedPool.block_tensors``
or ``SWASlots.slot_tensors``, back to back. Unpacking verifies the whole payload and the
body's size against the destination before it writes a single byte, and works for caches
on any device (the bytes go host -> device).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.cache import mxfp8
from engine.cache.pool import CompressedPool
from engine.cache.swa import SWASlots
from engine.kvconnector.payload import KIND_BLOCK, KIND_SLOT, PayloadError, decode, encode


def _dtype_of(tensors: list[torch.Tensor], what: str) -> torch.dtype:
    if not tensors:
        raise PayloadError(f"nothing to (un)pack: the {what} holds no tensors")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise PayloadError(f"the {what}'s tensors mix dtypes {sorted(map(str, dtypes))}")
    return tensors[0].dtype


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' raw bytes back to back, on their device: [sum of nbytes] uint8."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _pack(
    tensors: list[torch.Tensor],
    kind: int,
    fingerprint: bytes,
    digest: bytes,
    meta: Mapping[str, Any] | None,
    what: str,
) -> bytes:
    dtype = _dtype_of(tensors, what)
    return encode(kind, fingerprint, digest, dtype, [_concat(tensors)], meta)


def _unpack_into(
    payload: bytes | bytearray | memoryview,
    tensors: list[torch.Tensor],
    kind: int,
    fingerprint: bytes,
    digest: bytes,
    what: str,
) -> dict[str, Any]:
    """Verify everything, then copy the single body into ``tensors`` in order."""
    dtype = _dtype_of(tensors, what)
    dec = decode(payload, kind=kind, fingerprint=fingerprint, digest=digest, dtype=dtype)
    if len(dec.sections) != 1:
        raise PayloadError(f"a {what} payload has 1 section, found {len(dec.sections)}")
    body = dec.sections[0]
    sizes = [_nbytes(t) for t in tensors]
    if len(body) != sum(sizes):
        raise PayloadError(
            f"{what} body is {len(body)} bytes, this engine's {what} is {sum(sizes)} bytes "
            f"({len(tensors)} tensors); the layout digest passed does not describe this {what}"
        )
    if not body:
        return dec.meta
    src = torch.frombuffer(bytearray(body), dtype=torch.uint8)  # [sum(sizes)] CPU, writable copy
    off = 0
    for t, n in zip(tensors, sizes):
        t.copy_(src[off : off + n].view(t.dtype).view(t.shape))  # host -> t's device
        off += n
    return dec.meta


def pack_block(pool: CompressedPool, block: int, fingerprint: bytes, digest: bytes) -> bytes:
    """One physical block as a KIND_BLOCK payload: one section, the ``block_tensors`` bytes
    back to back, no metadata (header = HEADER_BYTES_BLOCK). IndexError out of range."""
    return _pack(pool.block_tensors(block), KIND_BLOCK, fingerprint, digest, None, "block")


def unpack_block_into(
    payload: bytes | bytearray | memoryview,
    pool: CompressedPool,
    block: int,
    fingerprint: bytes,
    digest: bytes,
) -> None:
    """Verify a KIND_BLOCK payload (all of `decode`'s checks plus the body size against this
    pool's block) and only then overwrite physical block ``block``. Raises PayloadError
    (block untouched) or IndexError (block out of range)."""
    _unpack_into(payload, pool.block_tensors(block), KIND_BLOCK, fingerprint, digest, "block")


SLOT_FORMATS = ("native", "mxfp8")


def pack_slot(
    swa: SWASlots,
    slot: int,
    fingerprint: bytes,
    digest: bytes,
    meta: Mapping[str, Any] | None = None,
    fmt: str = "native",
    layers: int | None = None,
) -> bytes:
    """One SWA slot as a KIND_SLOT payload: one section, the ``slot_tensors`` bytes back to
    back, plus optional metadata (see the reserved keys). IndexError out of range.

    ``fmt="mxfp8"`` stores every tensor whose last dimension is a multiple of 32 as MXFP8
    (``engine/cache/mxfp8.py``: its E4M3 values, then its scales) and the others as they are;
    the metadata says so (``"format": "mxfp8"``) and unpacking decodes it. It is lossy.
    ``layers`` keeps the first ``layers`` layers only (``"layers"`` in the metadata); unpacking
    writes those and leaves the others' rings as they are."""
    if fmt not in SLOT_FORMATS:
        raise ValueError(f"slot format must be one of {SLOT_FORMATS}, got {fmt!r}")
    tensors = swa.slot_tensors(slot, layers)
    meta = {**(meta or {}), **({} if layers is None else {"layers": layers})}
    if fmt == "native":
        return _pack(tensors, KIND_SLOT, fingerprint, digest, meta, "slot")
    dtype = _dtype_of(tensors, "slot")
    parts = []
    for t in tensors:
        if t.shape[-1] % mxfp8.BLOCK:
            parts.append(t.contiguous().reshape(-1).view(torch.uint8).cpu())
            continue
        values, scales = mxfp8.encode(t)
        parts += [values.reshape(-1).cpu(), scales.reshape(-1).cpu()]
    body = torch.cat(parts)
    return encode(KIND_SLOT, fingerprint, digest, dtype, [body], {**meta, "format": "mxfp8"})


def slot_layers(meta: Mapping[str, Any], swa: SWASlots) -> int | None:
    """The layers a slot payload holds (None: all of them); PayloadError if this engine has fewer."""
    layers = meta.get("layers")
    if layers is None:
        return None
    if not isinstance(layers, int) or not 1 <= layers <= swa.num_layers:
        raise PayloadError(f"slot payload keeps {layers!r} layers, this engine's slot has {swa.num_layers}")
    return layers


def unpack_slot_into(
    payload: bytes | bytearray | memoryview,
    swa: SWASlots,
    slot: int,
    fingerprint: bytes,
    digest: bytes,
) -> dict[str, Any]:
    """Verify a KIND_SLOT payload (native or MXFP8, every layer or the first ones), then
    overwrite slot ``slot`` (the layers it holds); returns its metadata. Raises PayloadError
    (slot untouched) or IndexError (slot out of range)."""
    dtype = _dtype_of(swa.slot_tensors(slot), "slot")
    dec = decode(payload, kind=KIND_SLOT, fingerprint=fingerprint, digest=digest, dtype=dtype)
    tensors = swa.slot_tensors(slot, slot_layers(dec.meta, swa))
    if dec.meta.get("format", "native") == "native":
        return _unpack_into(payload, tensors, KIND_SLOT, fingerprint, digest, "slot")
    if dec.meta["format"] != "mxfp8" or len(dec.sections) != 1:
        raise PayloadError(f"slot payload format {dec.meta['format']!r} is not one this engine reads")
    sizes = [
        mxfp8.encoded_bytes(t.numel()) if t.shape[-1] % mxfp8.BLOCK == 0 else _nbytes(t) for t in tensors
    ]
    body = dec.sections[0]
    if len(body) != sum(sizes):
        raise PayloadError(
            f"MXFP8 slot body is {len(body)} bytes, this engine's slot encodes to {sum(sizes)}"
        )
    src = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    off = 0
    for t, n in zip(tensors, sizes):
        chunk = src[off : off + n]
        if t.shape[-1] % mxfp8.BLOCK:
            t.copy_(chunk.view(t.dtype).view(t.shape))
        else:
            values = chunk[: t.numel()].view(t.shape)
            scales = chunk[t.numel() :].view(*t.shape[:-1], t.shape[-1] // mxfp8.BLOCK)
            t.copy_(mxfp8.decode(values, scales, t.dtype))
        off += n
    return dec.meta
