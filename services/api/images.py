"""Image intake: our limits from the file's framing, then recipe's resolver and token counts.

Two stages, both refusing with an ``ApiError`` (400) whose message says what was wrong and,
for a limit, which ``ApiConfig`` field:

1. ``check_image_bytes`` (also run before admission by ``limits.check_body``): media type,
   encoded size, format, the declared canvas and the file's framing, read without decoding
   a pixel. Recipe's resolver refuses only sides above 8192 px before decoding; a file of
   8000x8000 (a 60 KiB PNG or JPEG, 64 Mpx) it decodes in full (about 0.75 s and 200 MB
   here), so this pre-check keeps ``max_image_pixels`` (and ``max_image_side_px``) ahead
   of any decoder. It also refuses what a decoder would only discover later or
   never: truncated files (a PNG without IEND, a JPEG without EOI after its scan, a GIF
   without its trailer, a WebP shorter than its RIFF size), GIF frames outside the logical
   screen (a 1x1 screen can carry a 64 Mpx frame), animated GIF/PNG/WebP (the model sees
   one frame; recipe would silently keep the first), and JPEGs with hundreds of scans.
2. ``resolve_images`` (``Converter.prepare``, after admission): the recipe ``ImageSource``
   objects of the converted conversation, in placeholder order, each pre-checked again,
   then recipe's ``ImageResolver`` (its ``OpenCvImagePreprocessor``, the request's
   ``detail``) gives the ``MultiModalData`` and, per image, the V4.1 token count
   (``MultiModalData([info]).image_token_adjustment() + 1``).

Remote URLs are off unless ``allow_remote_images``; when on, the host must be in
``image_url_allow_hosts`` and every address it resolves to must be public (no loopback,
private, link-local, multicast or reserved ranges). The download goes through recipe's
``ReqwestImageFetcher`` whose destination filter applies both rules to every connection
(redirects and a DNS answer that changes between check and connect included). We fetch
the bytes ourselves and hand the resolver a ``BytesImageSource``, because the resolver
would decode a fetched file straight away, before our pre-check could see its header.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ipaddress
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes, urlsplit

from services.api.errors import ApiError, limit_error

if TYPE_CHECKING:
    import deepseek_recipe as dr

MEDIA_TYPES = {
    "image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/gif": "gif", "image/webp": "webp",
}  # fmt: skip
SUPPORTED = "PNG, JPEG, GIF or WebP"
RECIPE_MAX_SIDE_PX = 8192  # recipe's resolver refuses a longer side (ImageDimensionsTooLarge)
MAX_JPEG_SCANS = 100  # a progressive JPEG has ~10; each scan is a full pass of decoding work
MAX_BLOCKS = 100_000  # PNG chunks / GIF blocks walked; a 4 MiB single-frame GIF has ~16k
FETCH_TIMEOUT_S = 10.0  # recipe's fetcher gives up after 60 s; a request should not wait that long
FETCH_WORKERS = 8


@dataclass(frozen=True)
class ImageLimits:
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side_px: int
    allow_remote_images: bool
    allow_hosts: tuple[str, ...]


@dataclass(frozen=True)
class ImageHeader:
    """What the pre-check read from the file, without decoding it."""

    format: str  # png, jpeg, gif, webp
    width: int
    height: int


@dataclass(frozen=True)
class ResolvedImage:
    path: str  # the request location recipe gave the source
    detail: str  # low, high, original, auto
    source_width: int
    source_height: int
    width: int  # after recipe's preprocessing
    height: int
    tokens: int  # V4.1 image token count: what this image's one placeholder stands for


@dataclass(frozen=True)
class ImageIntake:
    """The images of one request, in placeholder order."""

    data: dr.MultiModalData  # recipe's preprocessed images, for the (future) vision encoder
    images: tuple[ResolvedImage, ...]

    @property
    def token_counts(self) -> tuple[int, ...]:
        return tuple(im.tokens for im in self.images)

    @property
    def extra_tokens(self) -> int:
        """Tokens beyond one per placeholder (``MultiModalData.image_token_adjustment``)."""
        return sum(self.token_counts) - len(self.images)


# -- data URLs and media types ---------------------------------------------------------------


def split_data_url(url: str, limits: ImageLimits, where: str) -> tuple[str, bytes]:
    """(media type, bytes) of a ``data:`` URL; size and media type refused before decoding."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ApiError(
            400, f"{where}: malformed data URL; expected data:<media type>;base64,<data>", param=where
        )
    is_b64 = head.endswith(";base64")
    media = (head[5:-7] if is_b64 else head[5:]).split(";", 1)[0].strip().lower()
    check_media_type(media, where)
    estimate = len(payload) * 3 // 4 if is_b64 else len(payload)
    if estimate > limits.max_image_bytes:
        raise limit_error(
            "max_image_bytes", f"{where}: image of ~{estimate} bytes exceeds {limits.max_image_bytes}"
        )
    try:
        data = base64.b64decode(payload, validate=True) if is_b64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: data URL is not valid base64", param=where) from None
    return media, data


def decode_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of a ``data:`` URL, refusing oversize payloads before decoding them."""
    return split_data_url(url, limits, where)[1]


def check_media_type(media: str, where: str) -> None:
    """The declared type must be one recipe decodes. A mislabelled PNG/JPEG/GIF/WebP is
    accepted and decoded as what its bytes are (many clients label everything image/jpeg)."""
    if media not in MEDIA_TYPES:
        raise ApiError(
            400,
            f"{where}: media type {media or '(none)'!r} is not supported; send image/png, image/jpeg, "
            "image/gif or image/webp",
            param=where,
        )


# -- the pre-check: framing and declared canvas, no decoding ---------------------------------


def check_image_bytes(data: bytes, limits: ImageLimits, where: str) -> tuple[int, int]:
    """Size, format, canvas and framing of one encoded image; returns (width, height)."""
    header = inspect_image(data, limits, where)
    return header.width, header.height


def inspect_image(data: bytes, limits: ImageLimits, where: str) -> ImageHeader:
    if len(data) > limits.max_image_bytes:
        raise limit_error(
            "max_image_bytes", f"{where}: image of {len(data)} bytes exceeds {limits.max_image_bytes}"
        )
    if not data:
        raise ApiError(400, f"{where}: image is empty (0 bytes)", param=where)
    fmt = sniff(data)
    if fmt is None:
        hint = _looks_like(data)
        raise ApiError(
            400,
            f"{where}: not a {SUPPORTED} image{hint} (or a truncated header)",
            param=where,
        )
    parse = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp}[fmt]
    header, finish = parse(data, where)
    w, h = header.width, header.height
    if w < 1 or h < 1:
        raise ApiError(400, f"{where}: {fmt.upper()} declares an empty canvas {w}x{h}", param=where)
    side = max(w, h)
    if side > limits.max_image_side_px:
        raise limit_error(
            "max_image_side_px", f"{where}: image side {side} px ({w}x{h}) exceeds {limits.max_image_side_px}"
        )
    if w * h > limits.max_image_pixels:
        raise limit_error(
            "max_image_pixels",
            f"{where}: image of {w}x{h} = {w * h} pixels exceeds {limits.max_image_pixels}",
        )
    finish()
    return header


def image_dimensions(data: bytes) -> tuple[int, int] | None:
    """(width, height) declared by the header, or None for an unknown or truncated file."""
    fmt = sniff(data)
    if fmt is None:
        return None
    try:
        header, _ = {"png": _png, "jpeg": _jpeg, "gif": _gif, "webp": _webp}[fmt](data, "")
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


def _looks_like(data: bytes) -> str:
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


# -- remote URLs -----------------------------------------------------------------------------


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


def check_image_ref(ref: str, limits: ImageLimits, where: str) -> ImageHeader | None:
    """The pre-admission check of one image reference (a URL string from the JSON body):
    a data URL is decoded and pre-checked; a remote URL is checked against the policy (its
    bytes are fetched and pre-checked later, in ``resolve_images``)."""
    if ref.startswith("data:"):
        _, data = split_data_url(ref, limits, where)
        return inspect_image(data, limits, where)
    if ref.startswith(("http://", "https://")) or (limits.allow_remote_images and "://" in ref):
        check_remote_url(ref, limits, where)
        return None
    if "://" in ref and not limits.allow_remote_images:
        raise limit_error("allow_remote_images", f"{where}: remote image URLs are disabled; send a data: URL")
    raise ApiError(400, f"{where}: image must be a data: URL (or an allowed http(s) URL)", param=where)


def _destination_allowed(limits: ImageLimits, host: str, address: str) -> bool:
    hosts = {h.lower() for h in limits.allow_hosts}
    return host.lower().strip("[]") in hosts and is_public_address(address)


@functools.lru_cache(maxsize=16)
def _components(limits: ImageLimits) -> tuple[Any, Any]:
    """(fetcher, resolver) for one set of limits; the fetcher connects only where
    ``_destination_allowed`` says (every redirect and resolved address included)."""
    import deepseek_recipe as dr

    fetcher = dr.ReqwestImageFetcher.with_max_bytes(limits.max_image_bytes).with_destination_filter(
        lambda host, address: _destination_allowed(limits, host, address)
    )
    return fetcher, dr.ImageResolver(fetcher, dr.OpenCvImagePreprocessor())


_fetch_slots = threading.BoundedSemaphore(FETCH_WORKERS)


def fetch_remote(url: str, limits: ImageLimits, where: str = "image_url") -> bytes:
    """Download an allowed image with recipe's fetcher, within ``FETCH_TIMEOUT_S``.

    The fetch runs on a daemon thread that holds one of ``FETCH_WORKERS`` slots until
    recipe's call returns (its own limit is 60 s), so a silent host costs the request at
    most ``FETCH_TIMEOUT_S`` and the process at most ``FETCH_WORKERS`` stuck threads.
    """
    from deepseek_recipe import ImageError

    timeout = FETCH_TIMEOUT_S
    if not _fetch_slots.acquire(timeout=timeout):
        raise ApiError(
            503, f"{where}: all {FETCH_WORKERS} image downloads are busy; retry shortly",
            code="image_fetch_busy", headers={"Retry-After": "1"},
        )  # fmt: skip
    fetcher, _ = _components(limits)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["data"] = bytes(fetcher.fetch(url))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
            box["error"] = exc
        finally:
            _fetch_slots.release()

    worker = threading.Thread(target=run, name="image-fetch", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise ApiError(400, f"{where}: downloading {url} took longer than {timeout:g} s", param=where)
    error = box.get("error")
    if isinstance(error, ImageError):
        raise _fetch_error(error, url, limits, where)
    if error is not None:
        raise ApiError(400, f"{where}: could not download {url}: {error}", param=where)
    return box["data"]


def _fetch_error(exc: Exception, url: str, limits: ImageLimits, where: str) -> ApiError:
    kind = getattr(exc, "kind", "")
    if kind == "DestinationRejected":
        return limit_error(
            "image_url_allow_hosts",
            f"{where}: {url} (or a redirect) leads to a host outside the allow-list or to a private, "
            "loopback or reserved address",
        )
    if kind == "ImageTooLarge":
        return limit_error(
            "max_image_bytes", f"{where}: the image at {url} exceeds {limits.max_image_bytes} bytes"
        )
    if kind == "FetchStatus":
        return ApiError(400, f"{where}: {url} answered with an error status", param=where)
    return ApiError(400, f"{where}: could not download {url} ({kind or 'fetch failed'})", param=where)


# -- stage 2: recipe's resolver ----------------------------------------------------------------


def resolve_images(sources: list[dr.ImageSource], limits: ImageLimits) -> ImageIntake:
    """Pre-check every source, then preprocess them all with recipe's resolver.

    ``sources`` are recipe's, in placeholder order (``RenderedPrompt.image_sources``). Each
    becomes a ``BytesImageSource`` (same detail and path) only after its bytes pass
    ``inspect_image``; a remote one is fetched first, within the allow-list filter.
    """
    import deepseek_recipe as dr

    if len(sources) > limits.max_images:
        raise limit_error("max_images", f"{len(sources)} images, more than {limits.max_images}")
    checked: list[tuple[ImageHeader, Any]] = []
    for i, src in enumerate(sources):
        where = src.path or f"image[{i}]"
        if src.kind == "data_url":
            _, data = split_data_url(src.data_url or "", limits, where)
        elif src.kind == "url":
            url = src.url or ""
            if url.startswith("data:"):
                _, data = split_data_url(url, limits, where)
            else:
                check_image_ref(url, limits, where)
                data = fetch_remote(url, limits, where)
        else:
            data = bytes(src.data or b"")
        header = inspect_image(data, limits, where)
        checked.append((header, dr.BytesImageSource(data, src.detail, path=where)))
    _, resolver = _components(limits)
    try:
        mm = resolver.resolve([s for _, s in checked], dr.ImageQuota())
    except dr.ImageError as exc:
        raise _resolve_error(exc, limits) from None
    infos = mm.images
    images = []
    for (header, src), info in zip(checked, infos, strict=True):
        try:
            tokens = dr.MultiModalData([info]).image_token_adjustment() + 1
        except dr.CalcResizeError:
            raise ApiError(
                400,
                f"{src.path}: the {header.width}x{header.height} image cannot be fitted to the model's "
                "image grid (aspect ratio too extreme)",
                param=src.path,
            ) from None
        images.append(
            ResolvedImage(
                src.path, src.detail, header.width, header.height, info.width, info.height, int(tokens)
            )
        )
    return ImageIntake(mm, tuple(images))


def _resolve_error(exc: Exception, limits: ImageLimits) -> ApiError:
    """recipe's message is the location then a generic 'unsupported image'; say what it was."""
    kind = getattr(exc, "kind", "")
    text = str(exc)
    where = text.split(": ", 1)[0].rsplit(".image[", 1)[0] if ": " in text else "image"
    if kind == "ImageDimensionsTooLarge":
        return limit_error(
            "max_image_side_px", f"{where}: image side exceeds recipe's {RECIPE_MAX_SIDE_PX} px"
        )
    if kind in ("Decode", "EmptyImage"):
        return ApiError(
            400,
            f"{where}: image data could not be decoded (corrupt or truncated pixel data); send a valid "
            f"{SUPPORTED} file",
            param=where,
        )
    if kind == "UnsupportedMediaType":
        return ApiError(400, f"{where}: not a {SUPPORTED} image", param=where)
    return ApiError(400, f"{where}: image refused by the preprocessor ({kind}): {text}", param=where)
