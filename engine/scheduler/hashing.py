"""Chained SHA-256 block identity for prefix caching.

A block's hash covers its parent's hash, its token ids (u32 little-endian) and the
request's extra keys (model id, image content hashes, cache salt). Two requests share a
block iff the hashes of every block up to and including it are equal, i.e. the whole
token prefix and the extra keys agree. The encoding is explicit bytes, so the result is
the same in every process and on every host (no ``hash()``, no PYTHONHASHSEED).

Layout hashed for one block::

    b"sluice-block-v1" | parent (32 bytes, zeros for the first block)
    | u32 len(extra) | for each extra key: u32 len | utf-8 bytes
    [| b"\x02img" | u32 n | for each image overlapping the block: u32 len | utf-8 key]
    | u32 n_tokens | n_tokens x u32 little-endian

Images: a prompt's image occupies a span of placeholder tokens (``ImageSpan``: offset, length,
key). The token ids of two images' spans are equal, so each block that overlaps a span also
hashes that image's key (its content hash, preprocessing options and encoder fingerprint);
through the chain, so does every block after it. The same image in the same prefix hits the
cache; another image misses from the block that holds its first token on. A block that
overlaps no image hashes exactly as it did before images existed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes  # 32 bytes
ROOT_HASH: BlockHash = b"\x00" * 32
_DOMAIN = b"sluice-block-v1"
_U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a sequence: ``tokens[offset : offset + length]``."""

    offset: int
    length: int
    key: str

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"an image span needs offset >= 0 and length >= 1, got {self.offset}, {self.length}"
            )


def image_keys(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The extra bytes of block ``[start, end)``: the keys of the images it overlaps, in order
    (empty when none)."""
    keys = [s.key.encode("utf-8") for s in spans if s.offset < end and s.offset + s.length > start]
    if not keys:
        return b""
    return b"\x02img" + struct.pack("<I", len(keys)) + b"".join(struct.pack("<I", len(k)) + k for k in keys)


@dataclass(frozen=True)
class ExtraKeys:
    """What besides token ids decides whether a cached block can be reused."""

    model_id: str = ""
    image_hashes: tuple[str, ...] = ()
    cache_salt: str = ""

    def encode(self) -> bytes:
        items = (self.model_id, self.cache_salt, *self.image_hashes)
        out = [struct.pack("<I", len(items))]
        for item in items:
            raw = item.encode("utf-8")
            out.append(struct.pack("<I", len(raw)))
            out.append(raw)
        return b"".join(out)


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
        raise ValueError(f"token ids must fit in u32, got range [{arr.min()}, {arr.max()}]")
    return arr.astype("<u4").tobytes()


def block_hash(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash, its tokens and encoded extra keys."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    h = hashlib.sha256()
    h.update(_DOMAIN)
    h.update(parent)
    h.update(extra)
    h.update(struct.pack("<I", len(tokens)))
    h.update(_tokens_bytes(tokens))
    return h.digest()


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    extra: ExtraKeys | None = None,
    parent: BlockHash = ROOT_HASH,
    images: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block is not hashed);
    ``parent`` is the hash before ``tokens[0]``, which sits at position 0 of the sequence
    whose ``images`` are given."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra_b = (extra or ExtraKeys()).encode()
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        parent = block_hash(parent, tokens[start:end], extra_b + image_keys(images, start, end))
        out.append(parent)
    return out


class BlockHasher:
    """Incremental hashes of a growing token sequence (prompt, then generated tokens)."""

    def __init__(
        self, block_size: int, extra: ExtraKeys | None = None, images: Sequence[ImageSpan] = ()
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._extra = (extra or ExtraKeys()).encode()
        self.images = tuple(images)
        self.hashes: list[BlockHash] = []

    def _block_extra(self, start: int, end: int) -> bytes:
        return self._extra + image_keys(self.images, start, end)

    def update(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Extend the hashes to cover every full block of ``tokens`` (the whole sequence)."""
        bs = self.block_size
        for i in range(len(self.hashes), len(tokens) // bs):
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            s, e = i * bs, (i + 1) * bs
            self.hashes.append(block_hash(parent, tokens[s:e], self._block_extra(s, e)))
        return self.hashes

    def tail_hash(self, tokens: Sequence[int], length: int) -> BlockHash:
        """Identity of the exact prefix ``tokens[:length]`` (full blocks plus a partial tail)."""
        full = length // self.block_size
        self.update(tokens[: full * self.block_size])
        parent = self.hashes[full - 1] if full else ROOT_HASH
        start = full * self.block_size
        return block_hash(parent, tokens[start:length], self._block_extra(start, length) + b"\x01tail")
