"""Image limits without decoding pixels: count, encoded bytes, and header dimensions.

A decompression bomb is a small file that declares a huge canvas; the guard is to read the
declared width and height from the format header (PNG IHDR, JPEG SOFn, GIF logical
screen, WebP VP8/VP8L/VP8X) and refuse before any decoder allocates. Unknown formats are
refused too: a format we cannot measure is a format we cannot bound.

Remote URLs are off unless ``allow_remote_images``; when on, the host must be in
``image_url_allow_hosts`` and every address it resolves to must be public (no loopback,
private, link-local, multicast or reserved ranges). The fetch itself goes through recipe's
``ReqwestImageFetcher`` with the same address rule as its destination filter, so a DNS
answer that changes between check and connect is still refused.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import struct
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

from services.api.errors import ApiError, limit_error


@dataclass(frozen=True)
class ImageLimits:
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side_px: int
    allow_remote_images: bool
    allow_hosts: tuple[str, ...]


def decode_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of a ``data:`` URL, refusing oversize payloads before decoding them."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ApiError(400, f"{where}: malformed data URL", param=where)
    is_b64 = head.endswith(";base64")
    estimate = len(payload) * 3 // 4 if is_b64 else len(payload)
    if estimate > limits.max_image_bytes:
        raise limit_error(
            "max_image_bytes", f"{where}: image of ~{estimate} bytes exceeds {limits.max_image_bytes}"
        )
    try:
        data = base64.b64decode(payload, validate=True) if is_b64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: data URL is not valid base64", param=where) from None
    return data


def check_image_bytes(data: bytes, limits: ImageLimits, where: str) -> tuple[int, int]:
    if len(data) > limits.max_image_bytes:
        raise limit_error(
            "max_image_bytes", f"{where}: image of {len(data)} bytes exceeds {limits.max_image_bytes}"
        )
    dims = image_dimensions(data)
    if dims is None:
        raise ApiError(
            400, f"{where}: not a PNG, JPEG, GIF or WebP image (or a truncated header)", param=where
        )
    w, h = dims
    if w < 1 or h < 1:
        raise ApiError(400, f"{where}: image declares an empty canvas {w}x{h}", param=where)
    if max(w, h) > limits.max_image_side_px:
        raise limit_error(
            "max_image_side_px", f"{where}: image side {max(w, h)} px exceeds {limits.max_image_side_px}"
        )
    if w * h > limits.max_image_pixels:
        raise limit_error(
            "max_image_pixels",
            f"{where}: image of {w}x{h} = {w * h} pixels exceeds {limits.max_image_pixels}",
        )
    return w, h


def image_dimensions(data: bytes) -> tuple[int, int] | None:
    """(width, height) declared by the header, or None for an unknown or truncated format."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return int(w), int(h)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return int(w), int(h)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_dimensions(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg_dimensions(data)
    return None


def _webp_dimensions(data: bytes) -> tuple[int, int] | None:
    kind = data[12:16]
    if kind == b"VP8X" and len(data) >= 30:
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return w, h
    if kind == b"VP8 " and len(data) >= 30:
        w, h = struct.unpack("<HH", data[26:30])
        return int(w) & 0x3FFF, int(h) & 0x3FFF
    if kind == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_dimensions(data: bytes) -> tuple[int, int] | None:
    i, n = 2, len(data)
    for _ in range(10_000):  # bounded marker walk
        while i < n and data[i] == 0xFF:
            i += 1
        if i + 3 > n:
            return None
        marker = data[i]
        i += 1
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            continue
        seg_len = int.from_bytes(data[i : i + 2], "big")
        if marker in _SOF:
            if i + 7 > n:
                return None
            h, w = struct.unpack(">HH", data[i + 3 : i + 7])
            return int(w), int(h)
        if seg_len < 2:
            return None
        i += seg_len
    return None


def is_public_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
        or ip.is_reserved or ip.is_unspecified
    )  # fmt: skip


def check_remote_url(url: str, limits: ImageLimits, where: str) -> str:
    """Refuse a remote image URL unless enabled, allow-listed and resolving to public addresses."""
    if not limits.allow_remote_images:
        raise limit_error("allow_remote_images", f"{where}: remote image URLs are disabled; send a data: URL")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ApiError(400, f"{where}: image URL must be http(s) with a host", param=where)
    if host not in {h.lower() for h in limits.allow_hosts}:
        raise limit_error(
            "image_url_allow_hosts", f"{where}: host {host!r} is not in the image URL allow-list"
        )
    try:
        infos = socket.getaddrinfo(host, parts.port or 443, type=socket.SOCK_STREAM)
    except OSError:
        raise ApiError(400, f"{where}: cannot resolve {host!r}", param=where) from None
    addresses = {str(info[4][0]) for info in infos}
    if not addresses or not all(is_public_address(a) for a in addresses):
        raise limit_error(
            "image_url_allow_hosts", f"{where}: {host!r} resolves to a private, loopback or reserved address"
        )
    return host


def fetch_remote(url: str, limits: ImageLimits) -> bytes:
    """Download an allowed image with recipe's fetcher; the destination filter re-checks addresses."""
    from deepseek_recipe import ImageError, ReqwestImageFetcher

    fetcher = ReqwestImageFetcher.with_max_bytes(limits.max_image_bytes).with_destination_filter(
        lambda _host, address: is_public_address(address)
    )
    try:
        return fetcher.fetch(url)
    except ImageError as exc:
        raise ApiError(400, f"image fetch failed ({exc.kind}): {exc}", param="image_url") from None
