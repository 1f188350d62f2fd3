"""Chained SHA-256 block identity for prefix caching.

A block's hash covers its parent's hash, its token ids (u32 little-endian) and the
request's extra keys (model id, image content hashes, cache salt). Two requests share a
block iff the hashes of every block up to and including it are equal, i.e. the whole
token prefix and the extra keys agree. The encoding is explicit bytes, so the result is
the same in every process and on every host (no ``hash()``, no PYTHONHASHSEED).

Layout hashed for one block::

    b"sluice-block-v1" | parent (32 bytes, zeros for the first block)
    | u32 len(extra) | for each extra key: u32 len | utf-8 bytes
    | u32 n_tokens | n_tokens x u32 little-endian
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
) -> list[BlockHash]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block is not hashed)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra_b = (extra or ExtraKeys()).encode()
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], extra_b)
        out.append(parent)
    return out


class BlockHasher:
    """Incremental hashes of a growing token sequence (prompt, then generated tokens)."""

    def __init__(self, block_size: int, extra: ExtraKeys | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._extra = (extra or ExtraKeys()).encode()
        self.hashes: list[BlockHash] = []

    def update(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Extend the hashes to cover every full block of ``tokens`` (the whole sequence)."""
        bs = self.block_size
        for i in range(len(self.hashes), len(tokens) // bs):
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], self._extra))
        return self.hashes

    def tail_hash(self, tokens: Sequence[int], length: int) -> BlockHash:
        """Identity of the exact prefix ``tokens[:length]`` (full blocks plus a partial tail)."""
        full = length // self.block_size
        self.update(tokens[: full * self.block_size])
        parent = self.hashes[full - 1] if full else ROOT_HASH
        return block_hash(parent, tokens[full * self.block_size : length], self._extra + b"\x01tail")
