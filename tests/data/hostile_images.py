"""Image payloads built in code (no imaging library, no binary files), and the hostile corpus.

Each generator writes a real, minimal file of its format: PNG (any colour type, real zlib
data; a large canvas is a real decompression bomb, a few tens of KiB that inflate to tens
of MB), baseline JPEG (grey, YCbCr or Adobe CMYK; every block is flat, 2 bits a block, so a
huge canvas is a small file), GIF (one frame or an animation) and WebP (a 38-byte lossless
file written by libwebp, its size fields patched).

``corpus()`` is the hostile set: ``(name, url, status, expect)``, whether the case needs
remote URLs switched on, and whether only the decoder (not the header pre-check) can tell. ``expect`` is a fragment of the error message the server must
give. ``accepted()`` lists the good controls, which must resolve to at least one image token.
The decisions for the borderline formats (animated GIF: refused; CMYK JPEG: accepted) are
explained in docs/api.md ("Images").
"""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from dataclasses import dataclass
from urllib.parse import quote_from_bytes

# -- generators ------------------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def png_idat(width: int, height: int, color_type: int = 0, bit_depth: int = 8, interlace: int = 0) -> bytes:
    """zlib stream of filtered rows of zero samples (Adam7 passes when interlaced),
    compressed row by row: a bomb of 64 Mpx costs 64 MB of zlib input, never 64 MB of memory.
    """
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    comp = zlib.compressobj(9)
    out = []
    for x0, y0, dx, dy in passes:
        pw, ph = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if pw <= 0 or ph <= 0:
            continue
        row = bytes(1 + (pw * _PNG_CHANNELS[color_type] * bit_depth + 7) // 8)
        out.extend(comp.compress(row) for _ in range(ph))
    out.append(comp.flush())
    return b"".join(out)


def png(
    width: int,
    height: int,
    color_type: int = 0,
    bit_depth: int = 8,
    *,
    idat: bytes | None = None,
    interlace: int = 0,
) -> bytes:
    """A complete PNG; colour type 3 gets a one-entry palette."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace)
    plte = _png_chunk(b"PLTE", b"\x80\x80\x80") if color_type == 3 else b""
    data = png_idat(width, height, color_type, bit_depth, interlace) if idat is None else idat
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + plte
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def jpeg(width: int, height: int, components: int = 1, *, adobe_transform: int | None = None) -> bytes:
    """A baseline JPEG whose every 8x8 block is flat grey (DC difference 0, then EOB).

    One quantisation table of ones; one DC and one AC Huffman table, each holding a single
    1-bit code (DC category 0, AC end-of-block), so a block costs 2 bits per component.
    ``components`` 4 with ``adobe_transform=0`` is an Adobe CMYK JPEG (the APP14 segment
    Photoshop writes); 3 is YCbCr (JFIF).
    """
    out = bytearray(b"\xff\xd8")
    if adobe_transform is not None:
        out += (
            b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + struct.pack(">HHHB", 100, 0, 0, adobe_transform)
        )
    else:
        out += b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    out += b"\xff\xdb" + struct.pack(">H", 67) + b"\x00" + b"\x01" * 64
    comps = b"".join(bytes([i + 1, 0x11, 0]) for i in range(components))
    out += b"\xff\xc0" + struct.pack(">HBHHB", 8 + 3 * components, 8, height, width, components) + comps
    one_code = bytes([1] + [0] * 15)  # one code of length 1
    out += b"\xff\xc4" + struct.pack(">H", 2 + 1 + 16 + 1) + b"\x00" + one_code + b"\x00"
    out += b"\xff\xc4" + struct.pack(">H", 2 + 1 + 16 + 1) + b"\x10" + one_code + b"\x00"
    scan = b"".join(bytes([i + 1, 0x00]) for i in range(components))
    out += b"\xff\xda" + struct.pack(">HB", 6 + 2 * components, components) + scan + b"\x00\x3f\x00"
    blocks = ((width + 7) // 8) * ((height + 7) // 8) * components
    bits = 2 * blocks
    out += bytes(bits // 8)
    if bits % 8:
        out.append(0xFF >> (bits % 8))  # zero code bits, then one-bits as padding
    out += b"\xff\xd9"
    return bytes(out)


def _gif_lzw(indices: list[int]) -> bytes:
    """LZW data (minimum code size 2) that sends a clear code before every second index,
    so the code width stays 3 bits: valid for any decoder, at no compression."""
    codes: list[int] = []
    for i, v in enumerate(indices):
        if i % 2 == 0:
            codes.append(4)  # clear
        codes.append(v)
    codes.append(5)  # end of information
    acc = nbits = 0
    raw = bytearray()
    for c in codes:
        acc |= c << nbits
        nbits += 3
        while nbits >= 8:
            raw.append(acc & 0xFF)
            acc >>= 8
            nbits -= 8
    if nbits:
        raw.append(acc & 0xFF)
    blocks = b"".join(bytes([len(raw[i : i + 255])]) + raw[i : i + 255] for i in range(0, len(raw), 255))
    return b"\x02" + blocks + b"\x00"


def gif(width: int, height: int, frames: int = 1, *, screen: tuple[int, int] | None = None) -> bytes:
    """A GIF89a of ``frames`` frames (a looping animation when more than one)."""
    sw, sh = screen or (width, height)
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", sw, sh, 0x80, 0, 0))
    out += b"\x00\x00\x00\xff\xff\xff"  # global colour table: black, white
    if frames > 1:
        out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    for f in range(frames):
        out += b"\x21\xf9\x04\x00" + struct.pack("<H", 10) + b"\x00\x00"  # 0.1 s a frame
        out += b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
        out += _gif_lzw([f % 2] * (width * height))
    out += b";"
    return bytes(out)


_WEBP_1X1 = bytes.fromhex("524946461e000000574542505650384c110000002f000000000750852257a1ff8188e87f0000")


def webp(width: int = 1, height: int = 1) -> bytes:
    """libwebp's lossless 1x1 file; other sizes only patch the header (a bomb's header)."""
    bits = (width - 1) | ((height - 1) << 14)
    return _WEBP_1X1[:21] + struct.pack("<I", bits) + _WEBP_1X1[25:]


def bmp(width: int, height: int) -> bytes:
    row = (width * 3 + 3) & ~3
    pixels = bytes(row * height)
    header = struct.pack("<2sIHHI", b"BM", 54 + len(pixels), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    return header + info + pixels


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


# -- the corpus ------------------------------------------------------------------------------

SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="64" height="64"/></svg>'
TIFF = b"II*\x00\x08\x00\x00\x00" + b"\x00" * 32
HEIC = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 16
PDF = b"%PDF-1.4\n1 0 obj << >> endobj\ntrailer << >>\n%%EOF\n"
MAX_IMAGE_BYTES = 4 * 2**20  # ApiConfig's default, which the corpus is written against


@dataclass(frozen=True)
class Hostile:
    name: str
    url: str  # a data: URL, or an http(s) URL
    status: int
    expect: str  # a fragment of the error message
    remote_on: bool = False  # the case is about a server with remote URLs switched on
    at_decode: bool = False  # passes the header pre-check; recipe's decoder refuses it

    @property
    def anthropic_source(self) -> dict[str, str] | None:
        """The same payload as an Anthropic ``base64`` source, where that shape can carry it."""
        head, sep, payload = self.url.partition(",")
        if not head.startswith("data:") or not head.endswith(";base64") or not sep:
            return None
        return {"type": "base64", "media_type": head[5:-7], "data": payload}


@functools.cache
def corpus() -> tuple[Hostile, ...]:
    good_png = png(16, 16)
    good_jpeg = jpeg(16, 16, 3)
    idat_garbage = png(16, 16, idat=b"\x78\x9c" + b"\xde\xad\xbe\xef" * 8)
    cases = [
        # truncation: refused from the file's framing, before any decoder runs
        Hostile("truncated PNG (cut inside IDAT)", data_url(good_png[: len(good_png) - 20]), 400, "truncated"),
        Hostile("truncated PNG (cut inside IHDR)", data_url(good_png[:20]), 400, "truncated"),
        Hostile("PNG without IEND", data_url(good_png[:-12]), 400, "truncated"),
        Hostile("truncated JPEG (cut inside the scan)", data_url(jpeg(64, 64, 3)[:-3], "image/jpeg"), 400, "truncated"),
        Hostile("truncated JPEG (cut before SOF)", data_url(good_jpeg[:30], "image/jpeg"), 400, "truncated"),
        Hostile("truncated GIF (no trailer)", data_url(gif(4, 4)[:-1], "image/gif"), 400, "truncated"),
        Hostile("truncated WebP (RIFF size past the end)", data_url(webp()[:30], "image/webp"), 400, "truncated"),
        # decompression bombs and absurd shapes: refused from the header
        Hostile("PNG decompression bomb (8000x8000, real zlib)", data_url(png(8000, 8000)), 400, "max_image_pixels"),
        Hostile("PNG bomb header (60000x60000)", data_url(png(60_000, 60_000, idat=b"\x78\x9c\x03\x00\x00\x00\x00\x01")), 400, "max_image_side_px"),
        Hostile("JPEG decompression bomb (8000x8000)", data_url(jpeg(8000, 8000), "image/jpeg"), 400, "max_image_pixels"),
        Hostile("GIF bomb (65535x65535 screen)", data_url(gif(1, 1, screen=(65535, 65535)), "image/gif"), 400, "max_image_side_px"),
        Hostile("GIF frame outside a small screen", data_url(gif(5000, 1, screen=(1, 1)), "image/gif"), 400, "outside"),
        Hostile("WebP bomb header (16000x16000)", data_url(webp(16_000, 16_000), "image/webp"), 400, "max_image_side_px"),
        Hostile("PNG 1 x 100,000", data_url(png(1, 100_000)), 400, "max_image_side_px"),
        Hostile("PNG 100,000 x 1", data_url(png(100_000, 1)), 400, "max_image_side_px"),
        Hostile("JPEG 1 x 60,000", data_url(jpeg(1, 60_000), "image/jpeg"), 400, "max_image_side_px"),
        Hostile("PNG 0 x 16 (empty canvas)", data_url(png(0, 16, idat=b"\x78\x9c\x03\x00\x00\x00\x00\x01")), 400, "empty canvas"),
        Hostile("JPEG height 0 (DNL)", data_url(jpeg(16, 0), "image/jpeg"), 400, "empty canvas"),
        # wrong types
        Hostile("wrong content type (text/plain)", data_url(good_png, "text/plain"), 400, "media type"),
        Hostile("wrong content type (application/octet-stream)", data_url(good_png, "application/octet-stream"), 400, "media type"),
        Hostile("SVG (image/svg+xml)", data_url(SVG, "image/svg+xml"), 400, "image/svg+xml"),
        Hostile("SVG labelled image/png", data_url(SVG), 400, "not a PNG"),
        Hostile("BMP (image/bmp)", data_url(bmp(4, 4), "image/bmp"), 400, "image/bmp"),
        Hostile("BMP labelled image/png", data_url(bmp(4, 4)), 400, "not a PNG"),
        Hostile("TIFF labelled image/jpeg", data_url(TIFF, "image/jpeg"), 400, "not a PNG"),
        Hostile("HEIC labelled image/jpeg", data_url(HEIC, "image/jpeg"), 400, "not a PNG"),
        Hostile("PDF (application/pdf)", data_url(PDF, "application/pdf"), 400, "media type"),
        Hostile("animated GIF (2 frames)", data_url(gif(4, 4, frames=2), "image/gif"), 400, "animated GIF"),
        Hostile("zero bytes", "data:image/png;base64,", 400, "empty"),
        Hostile("random bytes labelled image/png", data_url(bytes(range(256)) * 4), 400, "not a PNG"),
        Hostile("PNG with corrupt IDAT", data_url(idat_garbage), 400, "could not be decoded", at_decode=True),
        # data URL framing
        Hostile("invalid base64", "data:image/png;base64,@@@@not-base64@@@@", 400, "not valid base64"),
        Hostile("malformed data URL (no comma)", "data:image/png;base64", 400, "malformed data URL"),
        Hostile("data URL over max_image_bytes", "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 4 // 3 + 8), 400, "max_image_bytes"),
        Hostile("not a URL at all", "just some text", 400, "data: URL"),
        # remote URLs
        Hostile("URL while remote URLs are off", "https://images.example/cat.png", 400, "allow_remote_images"),
        Hostile("cloud metadata URL while remote URLs are off", "http://169.254.169.254/latest/meta-data", 400, "allow_remote_images"),
        Hostile("private-address URL while remote URLs are on (allow-listed host)", "http://localhost:9/cat.png", 400, "private, loopback", remote_on=True),
        Hostile("IP-literal URL while remote URLs are on", "http://10.0.0.1/cat.png", 400, "image_url_allow_hosts", remote_on=True),
        Hostile("host not on the allow-list", "https://evil.example/cat.png", 400, "image_url_allow_hosts", remote_on=True),
        Hostile("file: URL while remote URLs are on", "file:///etc/passwd", 400, "http(s)", remote_on=True),
    ]  # fmt: skip
    return tuple(cases)


@functools.cache
def accepted() -> tuple[tuple[str, str], ...]:
    """Good controls: (name, data URL); each must be accepted."""
    return (
        ("PNG 16x16 grey", data_url(png(16, 16))),
        ("PNG 16x16 RGBA", data_url(png(16, 16, 6))),
        ("PNG 16x16 palette", data_url(png(16, 16, 3))),
        ("PNG 16x16 16-bit", data_url(png(16, 16, 0, 16))),
        ("PNG 16x16 interlaced", data_url(png(16, 16, interlace=1))),
        ("JPEG 16x16 grey", data_url(jpeg(16, 16), "image/jpeg")),
        ("JPEG 64x48 YCbCr", data_url(jpeg(64, 48, 3), "image/jpeg")),
        ("CMYK JPEG (Adobe APP14)", data_url(jpeg(32, 32, 4, adobe_transform=0), "image/jpeg")),
        ("GIF 4x4 one frame", data_url(gif(4, 4), "image/gif")),
        ("WebP 1x1 lossless", data_url(webp(), "image/webp")),
        ("PNG labelled image/jpeg", data_url(png(16, 16), "image/jpeg")),
        ("percent-encoded PNG data URL", "data:image/png," + quote_from_bytes(png(8, 8))),
        ("PNG 4000x4000 (16 Mpx, at the limit)", data_url(png(4000, 4000))),
    )
