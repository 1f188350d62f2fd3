"""Image file headers, read without decoding a pixel: the format from the first bytes, the
declared canvas, and the framing a decoder would only discover later (truncation, GIF frames
outside the screen, animation, JPEG scan counts). ``services/api/images.py`` runs them before
any decoder sees the bytes; each parser returns the header and a ``finish`` callable that
walks the rest of the file, raising ``ApiError`` (400) on what it refuses.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

from services.api.errors import ApiError

MAX_JPEG_SCANS = 100  # a progressive JPEG has ~10; each scan is a full pass of decoding work
MAX_BLOCKS = 100_000  # PNG chunks / GIF blocks walked; a 4 MiB single-frame GIF has ~16k


@dataclass(frozen=True)
class ImageHeader:
    """What the pre-check read from the file, without decoding it."""

    format: str  # png, jpeg, gif, webp
    width: int
    height: int


def image_dimensions(data: bytes) -> tuple[int, int] | None:
    """(width, height) declared by the header, or None for an unknown or truncated file."""
    fmt = sniff(data)
    if fmt is None:
        return None
    try:
        header, _ = PARSERS[fmt](data, "")
    except ApiError:
        return None
    return header.width, header.height


def sniff(data: bytes) -> str | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def looks_like(data: bytes) -> str:
    head = data[:512].lstrip().lower()
    for sig, name in (
        (b"<svg", "SVG"), (b"<?xml", "XML/SVG"), (b"bm", "BMP"), (b"ii*\x00", "TIFF"), (b"mm\x00*", "TIFF"),
        (b"%pdf", "PDF"),
    ):  # fmt: skip
        if head.startswith(sig):
            return f" (it looks like {name})"
    if data[4:8] == b"ftyp":
        return " (it looks like HEIC/AVIF)"
    return ""


def _ok() -> None:
    return None


def _truncated(where: str, fmt: str, what: str) -> ApiError:
    return ApiError(400, f"{where}: {fmt} is truncated or malformed ({what})", param=where)


def _png(data: bytes, where: str) -> tuple[ImageHeader, Any]:
    if len(data) < 33:
        raise _truncated(where, "PNG", f"{len(data)} bytes end inside the IHDR header")
    if data[12:16] != b"IHDR":
        raise _truncated(where, "PNG", "the first chunk is not IHDR")
    w, h = struct.unpack(">II", data[16:24])

    def finish() -> None:
        pos, n, idat = 8, len(data), False
        for _ in range(MAX_BLOCKS):
            if pos + 12 > n:
                raise _truncated(where, "PNG", f"no IEND chunk; the file ends at byte {n}")
            length = int.from_bytes(data[pos : pos + 4], "big")
            kind = data[pos + 4 : pos + 8]
            if pos + 12 + length > n:
                raise _truncated(where, "PNG", f"chunk {kind!r} of {length} bytes runs past the end")
            if kind == b"IDAT":
                idat = True
            elif kind == b"acTL":
                raise ApiError(
                    400, f"{where}: animated PNG is not supported; send a single frame", param=where
                )
            elif kind == b"IEND":
                if not idat:
                    raise _truncated(where, "PNG", "no IDAT image data")
                return
            pos += 12 + length
        raise _truncated(where, "PNG", f"more than {MAX_BLOCKS} chunks")

    return ImageHeader("png", int(w), int(h)), finish


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_segments(data: bytes, start: int) -> Any:
    """(marker, payload offset, payload length) of each marker segment from ``start``,
    up to and including the first start-of-scan; ``None`` marks a file that ends early."""
    i, n = start, len(data)
    for _ in range(MAX_BLOCKS):
        while i < n and data[i] == 0xFF:
            i += 1
        if i + 2 >= n:
            yield None
            return
        marker = data[i]
        i += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            continue
        if marker == 0xD9:
            yield None
            return
        seg_len = int.from_bytes(data[i : i + 2], "big")
        if seg_len < 2 or i + seg_len > n:
            yield None
            return
        yield marker, i, seg_len
        if marker == 0xDA:
            return
        i += seg_len
    yield None


def _jpeg(data: bytes, where: str) -> tuple[ImageHeader, Any]:
    for seg in _jpeg_segments(data, 2):
        if seg is None:
            break
        marker, i, seg_len = seg
        if marker == 0xDA:
            raise _truncated(where, "JPEG", "a scan before the frame header (SOF)")
        if marker in _SOF:
            if seg_len < 7:
                break
            h, w = struct.unpack(">HH", data[i + 3 : i + 7])
            after_sof = i + seg_len

            def finish(after_sof: int = after_sof) -> None:
                sos = -1
                for seg in _jpeg_segments(data, after_sof):
                    if seg is not None and seg[0] == 0xDA:
                        sos = seg[1]
                if sos < 0:
                    raise _truncated(where, "JPEG", "ends before its scan")
                if data.rfind(b"\xff\xd9") < sos:
                    raise _truncated(where, "JPEG", "no end-of-image marker after the scan")
                scans = data.count(b"\xff\xda")
                if scans > MAX_JPEG_SCANS:
                    raise ApiError(
                        400,
                        f"{where}: JPEG has {scans} scans; at most {MAX_JPEG_SCANS} are accepted",
                        param=where,
                    )

            return ImageHeader("jpeg", int(w), int(h)), finish
    raise _truncated(where, "JPEG", "ends before its frame header (SOF)")


def _gif(data: bytes, where: str) -> tuple[ImageHeader, Any]:
    if len(data) < 13:
        raise _truncated(where, "GIF", f"{len(data)} bytes end inside the screen descriptor")
    sw, sh, flags = struct.unpack("<HHB", data[6:11])
    return ImageHeader("gif", int(sw), int(sh)), functools.partial(_gif_blocks, data, where, sw, sh, flags)


def _gif_sub_blocks(data: bytes, where: str, p: int) -> int:
    n = len(data)
    for _ in range(MAX_BLOCKS):
        if p >= n:
            raise _truncated(where, "GIF", f"no trailer; the file ends at byte {n}")
        size = data[p]
        p += 1 + size
        if size == 0:
            return p
    raise _truncated(where, "GIF", f"more than {MAX_BLOCKS} blocks")


def _gif_blocks(data: bytes, where: str, sw: int, sh: int, flags: int) -> None:
    """Walk the blocks to the trailer: one frame, inside the logical screen."""
    n = len(data)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    frames = 0
    for _ in range(MAX_BLOCKS):
        if pos >= n:
            raise _truncated(where, "GIF", f"no trailer; the file ends at byte {n}")
        block = data[pos]
        if block == 0x3B:
            if frames == 0:
                raise _truncated(where, "GIF", "no image in the file")
            return
        if block == 0x21:  # extension: label, then sub-blocks
            pos = _gif_sub_blocks(data, where, pos + 2)
            continue
        if block != 0x2C:
            raise _truncated(where, "GIF", f"unknown block 0x{block:02x} at byte {pos}")
        if pos + 10 > n:  # image descriptor
            raise _truncated(where, "GIF", "ends inside an image descriptor")
        left, top, fw, fh, fflags = struct.unpack("<HHHHB", data[pos + 1 : pos + 10])
        if left + fw > sw or top + fh > sh:
            raise ApiError(
                400,
                f"{where}: GIF frame {fw}x{fh} at ({left}, {top}) lies outside the {sw}x{sh} logical screen",
                param=where,
            )
        frames += 1
        if frames > 1:
            raise ApiError(
                400,
                f"{where}: animated GIF (more than one frame) is not supported; send a single frame as "
                "PNG, JPEG, WebP or a one-frame GIF",
                param=where,
            )
        pos += 10 + (3 << ((fflags & 7) + 1) if fflags & 0x80 else 0)
        pos = _gif_sub_blocks(data, where, pos + 1)  # LZW minimum code size, then the data
    raise _truncated(where, "GIF", f"more than {MAX_BLOCKS} blocks")


def _webp(data: bytes, where: str) -> tuple[ImageHeader, Any]:
    riff_size = int.from_bytes(data[4:8], "little")
    if riff_size + 8 > len(data):
        raise _truncated(where, "WebP", f"RIFF size {riff_size + 8} but {len(data)} bytes")
    kind = data[12:16]
    if kind == b"VP8X" and len(data) >= 30:
        if data[20] & 0x02:
            raise ApiError(400, f"{where}: animated WebP is not supported; send a single frame", param=where)
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return ImageHeader("webp", w, h), _ok
    if kind == b"VP8 " and len(data) >= 30:
        w, h = struct.unpack("<HH", data[26:30])
        return ImageHeader("webp", int(w) & 0x3FFF, int(h) & 0x3FFF), _ok
    if kind == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return ImageHeader("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1), _ok
    raise _truncated(where, "WebP", f"no VP8/VP8L/VP8X header (chunk {kind!r})")


PARSERS = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp}
