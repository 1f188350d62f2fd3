"""The API's cache of preprocessed images (``resolve_images`` and the admission check use it)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from services.api.image_headers import ImageHeader


@dataclass(frozen=True)
class Preprocessed:
    """One image as recipe's preprocessor left it, and what the pre-check read from it."""

    data: bytes  # recipe's WebP bytes
    width: int  # after preprocessing
    height: int
    tokens: int  # V4.1 image token count
    header: ImageHeader  # the original file's format and declared size


class PreprocessCache:
    """Preprocessed images by the SHA-256 of what the client sent and the ``detail``: a
    conversation re-sends every image each turn, and a hit skips the decode and resize.

    A data URL's key hashes its base64 text, so a hit also skips decoding the base64 and the
    pre-check (strict base64 text names its bytes exactly, and those bytes passed
    ``inspect_image`` under this server's fixed limits when the entry was made); other
    sources (downloads) are keyed by their bytes, after the pre-check. Least recently used
    first out, bounded in bytes; thread-safe.

    It also remembers the pre-check's verdict on the last ``MAX_CHECKED`` data URLs that
    passed it (by the same digest), so the admission check (``limits.check_body``) and the
    preprocessing decode and inspect a new image once between them, and a re-sent one never."""

    MAX_CHECKED = 4096  # headers are a few dozen bytes each

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[bytes, str], Preprocessed] = OrderedDict()
        self._checked: OrderedDict[bytes, ImageHeader] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def base64_digest(text: str) -> bytes:
        """What names a data URL's base64 text (not decoded)."""
        return hashlib.sha256(b"base64\0" + text.encode("ascii", "replace")).digest()

    def checked(self, digest: bytes) -> ImageHeader | None:
        """The pre-check's header for base64 text that passed it, if remembered."""
        with self._lock:
            header = self._checked.get(digest)
            if header is not None:
                self._checked.move_to_end(digest)
            return header

    def remember_checked(self, digest: bytes, header: ImageHeader) -> None:
        with self._lock:
            self._checked[digest] = header
            self._checked.move_to_end(digest)
            while len(self._checked) > self.MAX_CHECKED:
                self._checked.popitem(last=False)

    @staticmethod
    def key(data: bytes, detail: str) -> tuple[bytes, str]:
        """The key of an image's bytes."""
        return hashlib.sha256(b"bytes\0" + data).digest(), detail

    def get(self, key: tuple[bytes, str]) -> Preprocessed | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def put(self, key: tuple[bytes, str], item: Preprocessed) -> None:
        size = len(item.data)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            while self._items and self._bytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old.data)
            self._items[key] = item
            self._bytes += size
