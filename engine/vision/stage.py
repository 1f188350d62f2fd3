"""The vision stage: a prompt's preprocessed images -> the embedding rows of their spans.

The API resolves each image with deepseek-recipe (decode, resize to the V4.1 grid) and
expands its one placeholder to the image's token count; what reaches the engine side is an
`ImagePart` per image: the recipe's preprocessed bytes (WebP), their size, and the span of
placeholder tokens. `VisionStage.encode` turns each into an ``engine.messages.ImageInput``:

- its **key** is a SHA-256 over the preprocessed bytes, their size and the encoder's
  fingerprint (`engine.model.vision.vision_fingerprint`: its config and weights). Equal keys
  mean equal rows, so the key names the image in the block hash chain and in the cache;
- its **rows** come from the encoder cache (least recently used first out, bounded in
  bytes) or from `VisionEncoder` (`engine/model/vision.py`), which must produce exactly the
  span's length (the recipe's count): a mismatch is refused, never padded or cut.

Thread-safe: API workers encode concurrently; the encoder runs one image at a time under a
lock (its own threads parallelise each forward).

Rows computed in another process (a vision-pool instance on Ray, ``services/ray/vision.py``)
travel as an `EncodedImage`: the span, the key and the rows as one payload in the engine's
byte format (``engine.kvconnector.payload``, kind ``KIND_EMBEDDING``, never pickled):
`RowsFormat` packs and verifies them (`VisionStage.encode_payloads` makes them).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.scheduler.request import ImageInput
from engine.vision.preprocess import pixels_of

DEFAULT_CACHE_BYTES = 256 << 20
_KEY_DOMAIN = b"sluice-image-rows-v1"


@dataclass(frozen=True)
class ImagePart:
    """One image of a prompt as the API hands it on: its span of placeholder tokens and the
    recipe's preprocessed image (``ImageInfo``: WebP bytes, width, height in pixels)."""

    offset: int
    length: int
    data: bytes
    width: int
    height: int


def expand_placeholders(
    prompt_ids: Sequence[int], image_id: int, images: Sequence[tuple[Any, int]]
) -> tuple[list[int], tuple[ImagePart, ...]]:
    """Each image's one placeholder (``image_id``, as deepseek-recipe renders it) becomes its
    token count of placeholders. ``images``: per placeholder in order, (the recipe's
    ``ImageInfo``, its V4.1 token count). Returns the expanded ids and each image's
    `ImagePart`; ValueError when the placeholders and the images do not pair up."""
    at = [i for i, t in enumerate(prompt_ids) if t == image_id]
    if len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} image placeholders for {len(images)} images")
    out: list[int] = []
    parts = []
    prev = 0
    for pos, (info, tokens) in zip(at, images):
        out += prompt_ids[prev:pos]
        parts.append(ImagePart(len(out), int(tokens), bytes(info.data), int(info.width), int(info.height)))
        out += [image_id] * int(tokens)
        prev = pos + 1
    out += prompt_ids[prev:]
    return out, tuple(parts)


@dataclass(frozen=True)
class EncodedImage:
    """An image whose rows were computed elsewhere: its span of placeholder tokens, its key
    (`VisionStage.key`) and its rows as a ``KIND_EMBEDDING`` payload (`RowsFormat.pack`)."""

    offset: int
    length: int
    key: str
    rows: bytes


@dataclass(frozen=True)
class RowsFormat:
    """How an encoder's rows for one image travel as bytes: a ``KIND_EMBEDDING`` payload of
    ``engine.kvconnector.payload`` with one section (the [length, hidden] rows' raw bytes,
    row-major) and metadata ``{key, length, hidden}``. The payload's fingerprint names the
    encoder (its ``vision_fingerprint``), its layout digest the row width and dtype, so a
    receiver refuses rows from another encoder, of another width or dtype."""

    fingerprint: str  # the encoder's vision_fingerprint
    hidden: int  # the language model's hidden_size: the width of a row
    dtype: torch.dtype

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: torch.dtype) -> RowsFormat | None:
        """The format of rows made by the checkpoint's encoder, read from its config and
        weight file's digest without building the encoder (for an engine whose images a
        vision pool encodes); None when the checkpoint has no vision section."""
        from engine.model.vision import VisionConfig, vision_fingerprint

        section = json.loads((Path(model_dir) / "config.json").read_text()).get("vision")
        if not section:
            return None
        hidden = VisionConfig.from_dict(section).text_hidden_size
        return cls(vision_fingerprint(model_dir), int(hidden), dtype)

    def _identity(self) -> tuple[bytes, bytes]:
        fp = hashlib.sha256(_KEY_DOMAIN + b"\0" + self.fingerprint.encode()).digest()
        desc = {"rows_version": 1, "hidden": int(self.hidden), "dtype": str(self.dtype)}
        digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:8]
        return fp, digest

    def pack(self, key: str, rows: torch.Tensor) -> bytes:
        """One image's rows [length, hidden] (cast to this format's dtype) as a payload."""
        from engine.kvconnector import payload

        if rows.dim() != 2 or rows.shape[1] != self.hidden:
            raise payload.PayloadError(f"rows must be [length, {self.hidden}], got {list(rows.shape)}")
        fp, digest = self._identity()
        meta = {"key": key, "length": int(rows.shape[0]), "hidden": int(self.hidden)}
        body = rows.detach().to("cpu", self.dtype).contiguous()
        return payload.encode(payload.KIND_EMBEDDING, fp, digest, self.dtype, [body], meta)

    def verify(self, buf: bytes | bytearray | memoryview) -> tuple[str, int]:
        """(key, row count) of a payload made by `pack` with this format, verified without
        materialising the rows: ``PayloadError`` (a ValueError) for corrupt bytes, rows of
        another encoder, width or dtype, or metadata that does not match the body."""
        return self._open(buf)[:2]

    def unpack(self, buf: bytes | bytearray | memoryview) -> tuple[str, torch.Tensor]:
        """(key, rows [length, hidden]) of a payload made by `pack` with this format (a copy
        of its bytes); ``PayloadError`` as `verify`."""
        key, length, body = self._open(buf)
        rows = (
            torch.frombuffer(bytearray(body), dtype=self.dtype)
            if len(body)
            else torch.empty(0, dtype=self.dtype)
        )
        return key, rows.reshape(length, self.hidden)

    def _open(self, buf: bytes | bytearray | memoryview) -> tuple[str, int, memoryview]:
        from engine.kvconnector import payload

        fp, digest = self._identity()
        dec = payload.decode(
            buf, kind=payload.KIND_EMBEDDING, fingerprint=fp, digest=digest, dtype=self.dtype
        )
        meta = dec.meta
        key, length, hidden = meta.get("key"), meta.get("length"), meta.get("hidden")
        if not isinstance(key, str) or not isinstance(length, int) or length < 0 or hidden != self.hidden:
            raise payload.PayloadError(
                f"embedding metadata must be {{key, length, hidden: {self.hidden}}}, got {meta!r:.200}"
            )
        if len(dec.sections) != 1:
            raise payload.PayloadError(f"an embedding payload has 1 section, got {len(dec.sections)}")
        (body,) = dec.sections
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        if len(body) != length * self.hidden * itemsize:
            raise payload.PayloadError(
                f"embedding body is {len(body)} bytes; {length} rows of {self.hidden} need "
                f"{length * self.hidden * itemsize}"
            )
        return key, length, body

    def image_input(self, image: EncodedImage) -> ImageInput:
        """The engine's input for an image encoded elsewhere; ``PayloadError`` unless the
        payload's key and row count are the image's."""
        from engine.kvconnector.payload import PayloadError

        key, rows = self.unpack(image.rows)
        if key != image.key or rows.shape[0] != image.length:
            raise PayloadError(
                f"embedding payload holds {rows.shape[0]} rows of image {key[:12]}..., the prompt "
                f"expects {image.length} of {image.key[:12]}..."
            )
        return ImageInput(image.offset, image.length, key, rows)


def rows_key(part: ImagePart, fingerprint: str) -> str:
    """An image's key (module doc): SHA-256 over its preprocessed bytes, their size and the
    encoder's fingerprint. The router computes it too, to hash prompts as the engines do."""
    h = hashlib.sha256(_KEY_DOMAIN)
    for piece in (part.data, f"{part.width}x{part.height}".encode(), fingerprint.encode()):
        h.update(len(piece).to_bytes(8, "little"))
        h.update(piece)
    return h.hexdigest()


class VisionStage:
    def __init__(self, encoder: Any, fingerprint: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if cache_bytes < 0:
            raise ValueError(f"the encoder cache needs a byte budget >= 0, got {cache_bytes}")
        self.encoder = encoder
        self.fingerprint = fingerprint
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache and the counters
        self._run = threading.Lock()  # one forward at a time
        self.encoded = self.hits = self.waiting = 0
        self.encode_s = 0.0

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> VisionStage | None:  # fmt: skip
        """The checkpoint's encoder behind a cache, or None when it has no vision section."""
        from engine.model.vision import load_vision_encoder, vision_fingerprint

        encoder = load_vision_encoder(model_dir, device, dtype)
        return None if encoder is None else cls(encoder, vision_fingerprint(model_dir), cache_bytes)

    def key(self, part: ImagePart) -> str:
        return rows_key(part, self.fingerprint)

    def encode(self, parts: Sequence[ImagePart]) -> tuple[ImageInput, ...]:
        """Each part's key and rows (cached, else encoded); ValueError when the encoder's row
        count is not the span's length (the API and the encoder disagree on the image)."""
        return tuple(
            ImageInput(p.offset, p.length, k, self._rows(p, k)) for p in parts for k in [self.key(p)]
        )

    def rows_format(self, dtype: torch.dtype) -> RowsFormat:
        """How this encoder's rows travel, at ``dtype`` (the encoder's and the engines')."""
        return RowsFormat(self.fingerprint, int(self.encoder.config.text_hidden_size), dtype)

    def encode_payloads(self, parts: Sequence[ImagePart], fmt: RowsFormat) -> list[bytes]:
        """`encode`, each image's rows packed as a payload of ``fmt`` (one per part, in order)."""
        return [fmt.pack(img.key, img.embeds) for img in self.encode(parts)]

    def _rows(self, part: ImagePart, key: str) -> torch.Tensor:
        with self._lock:
            rows = self._cache.get(key)
            if rows is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return rows
            self.waiting += 1
        try:
            pixels = pixels_of(part.data, part.width, part.height, *self._norm())
            with self._run, torch.inference_mode():
                t0 = time.perf_counter()
                rows = self.encoder(pixels).detach().cpu()
                took = time.perf_counter() - t0
        finally:
            with self._lock:
                self.waiting -= 1
        if rows.shape[0] != part.length:
            raise ValueError(
                f"the vision encoder made {rows.shape[0]} rows for a {part.width}x{part.height} image "
                f"whose prompt span is {part.length} tokens"
            )
        with self._lock:
            self.encoded += 1
            self.encode_s += took
            self._put(key, rows)
        return rows

    def _norm(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        cfg = self.encoder.config
        return tuple(cfg.image_mean), tuple(cfg.image_std)

    def _put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.cache_bytes:
            return
        while self._cache and self._cached_bytes + size > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.numel() * old.element_size()
        self._cache[key] = rows
        self._cached_bytes += size

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "vision_images_encoded": float(self.encoded),
                "vision_cache_hits": float(self.hits),
                "vision_encode_s": self.encode_s,
                "vision_queue": float(self.waiting),
                "vision_cache_bytes": float(self._cached_bytes),
            }
