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
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes, urlsplit

from services.api.errors import ApiError, limit_error
from services.api.image_cache import PreprocessCache, Preprocessed
from services.api.image_headers import PARSERS, ImageHeader, looks_like, sniff

if TYPE_CHECKING:
    import deepseek_recipe as dr

MEDIA_TYPES = {
    "image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/gif": "gif", "image/webp": "webp",
}  # fmt: skip
SUPPORTED = "PNG, JPEG, GIF or WebP"
RECIPE_MAX_SIDE_PX = 8192  # recipe's resolver refuses a longer side (ImageDimensionsTooLarge)
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
    media, payload, is_b64 = check_data_url(url, limits, where)
    return media, _decode_data_url(payload, is_b64, where)


def check_data_url(url: str, limits: ImageLimits, where: str) -> tuple[str, str, bool]:
    """(media type, payload text, is base64) of a ``data:`` URL, its declared media type and
    size checked; nothing decoded."""
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
    return media, payload, is_b64


def _decode_data_url(payload: str, is_b64: bool, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True) if is_b64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: data URL is not valid base64", param=where) from None


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
        hint = looks_like(data)
        raise ApiError(
            400,
            f"{where}: not a {SUPPORTED} image{hint} (or a truncated header)",
            param=where,
        )
    parse = PARSERS[fmt]
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


def check_image_ref(
    ref: str, limits: ImageLimits, where: str, cache: PreprocessCache | None = None
) -> ImageHeader | None:
    """The pre-admission check of one image reference (a URL string from the JSON body):
    a data URL is decoded and pre-checked (unless ``cache`` remembers that its text passed);
    a remote URL is checked against the policy (its bytes are fetched and pre-checked later,
    in ``resolve_images``)."""
    if ref.startswith("data:"):
        _, text, is_b64 = check_data_url(ref, limits, where)
        digest = PreprocessCache.base64_digest(text) if cache is not None and is_b64 else None
        if cache is not None and digest is not None and (known := cache.checked(digest)) is not None:
            return known
        header = inspect_image(_decode_data_url(text, is_b64, where), limits, where)
        if cache is not None and digest is not None:
            cache.remember_checked(digest, header)
        return header
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


@dataclass
class _Pending:
    """One source on its way through ``resolve_images``."""

    where: str
    detail: Any
    key: tuple[bytes, str]
    found: Preprocessed | None = None
    header: ImageHeader | None = None
    source: Any = None  # recipe's BytesImageSource, when it must be preprocessed


def resolve_images(
    sources: list[dr.ImageSource],
    limits: ImageLimits,
    cache: PreprocessCache | None = None,
    originals: dict[str, str] | None = None,
) -> ImageIntake:
    """Pre-check every source, then preprocess them all with recipe's resolver (those
    ``cache`` does not hold).

    ``sources`` are recipe's, in placeholder order (``RenderedPrompt.image_sources``). Each
    becomes a ``BytesImageSource`` (same detail and path) only after its bytes pass
    ``inspect_image``; a remote one is fetched first, within the allow-list filter. A data
    URL ``cache`` holds is neither decoded nor pre-checked again (see ``PreprocessCache``).
    ``originals``: a `Lifted` request's way back from stand-ins to the client's data URLs.
    """
    import deepseek_recipe as dr

    if len(sources) > limits.max_images:
        raise limit_error("max_images", f"{len(sources)} images, more than {limits.max_images}")
    pending: list[_Pending] = []
    for i, src in enumerate(sources):
        where, detail = src.path or f"image[{i}]", str(src.detail)
        url = {"data_url": src.data_url, "url": src.url}.get(src.kind)
        if originals and url is not None:
            url = originals.get(url, url)
        key, header = None, None
        if url is not None and url.startswith("data:"):
            _, text, is_b64 = check_data_url(url, limits, where)
            if is_b64:
                key = (PreprocessCache.base64_digest(text), detail)
                found = cache.get(key) if cache is not None else None
                if found is not None:  # seen before: not decoded nor pre-checked again
                    pending.append(_Pending(where, src.detail, key, found))
                    continue
                header = cache.checked(key[0]) if cache is not None else None
            data = _decode_data_url(text, is_b64, where)
        elif url is not None:
            check_image_ref(url, limits, where)
            data = fetch_remote(url, limits, where)
        else:
            data = bytes(src.data or b"")
        if header is None:
            header = inspect_image(data, limits, where)
            if key is not None and cache is not None:
                cache.remember_checked(key[0], header)
        found = None
        if key is None:
            key = PreprocessCache.key(data, detail)
            found = cache.get(key) if cache is not None else None
        source = None if found is not None else dr.BytesImageSource(data, src.detail, path=where)
        pending.append(_Pending(where, src.detail, key, found, header, source))
    todo = [p.source for p in pending if p.found is None]
    fresh = iter(_preprocess(todo, limits) if todo else [])
    infos, images = [], []
    for p in pending:
        hit = p.found
        if hit is None:
            info, checked = next(fresh), p.header
            assert checked is not None  # every source preprocessed here was pre-checked
            hit = Preprocessed(
                bytes(info.data), int(info.width), int(info.height), _tokens(info, checked, p.where), checked
            )
            if cache is not None:
                cache.put(p.key, hit)
        infos.append(dr.ImageInfo(hit.data, hit.width, hit.height))
        images.append(
            ResolvedImage(
                p.where, p.detail, hit.header.width, hit.header.height, hit.width, hit.height, hit.tokens
            )
        )
    return ImageIntake(dr.MultiModalData(infos), tuple(images))


def _preprocess(sources: list[Any], limits: ImageLimits) -> list[Any]:
    """Recipe's resolver over checked ``BytesImageSource``s: their ``ImageInfo``s, in order."""
    import deepseek_recipe as dr

    _, resolver = _components(limits)
    try:
        return list(resolver.resolve(sources, dr.ImageQuota()).images)
    except dr.ImageError as exc:
        raise _resolve_error(exc, limits) from None


def _tokens(info: Any, header: ImageHeader, path: str) -> int:
    """One image's V4.1 token count (``image_token_adjustment`` counts those beyond one)."""
    import deepseek_recipe as dr

    try:
        return int(dr.MultiModalData([info]).image_token_adjustment()) + 1
    except dr.CalcResizeError:
        raise ApiError(
            400,
            f"{path}: the {header.width}x{header.height} image cannot be fitted to the model's "
            "image grid (aspect ratio too extreme)",
            param=path,
        ) from None


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
