"""The KV connector's worker side: block and slot payloads in and out of the engine's caches.

It runs on the executor thread, in step order: loads before a step's forward (store hits,
imported sequences), snapshots of newly published blocks after it (write-through). Every
payload is verified (``engine.kvconnector.payload``) before a byte reaches a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.kvconnector import caches
from engine.kvconnector import payload as fmt
from engine.kvconnector.connector import SaveItem, StoreConnector


class KVWorker:
    """``fingerprint``: the model fingerprint's raw bytes; ``digest``: ``fmt.layout_digest``."""

    def __init__(self, fingerprint: bytes, digest: bytes, dtype: Any, store: StoreConnector | None = None):
        self.fingerprint = fingerprint[:16]
        self.digest = digest
        self.dtype = dtype
        self.store = store

    def verify_block(self, payload: bytes) -> None:
        """Raise ``PayloadError`` unless ``payload`` is a block this engine can use."""
        fmt.decode(
            payload, kind=fmt.KIND_BLOCK, fingerprint=self.fingerprint, digest=self.digest, dtype=self.dtype
        )

    def load_block(self, pool: Any, block: int, payload: bytes) -> None:
        caches.unpack_block_into(payload, pool, block, self.fingerprint, self.digest)

    def load_slot(self, swa: Any, slot: int, payload: bytes) -> None:
        caches.unpack_slot_into(payload, swa, slot, self.fingerprint, self.digest)

    def pack_block(self, pool: Any, block: int) -> bytes:
        return caches.pack_block(pool, block, self.fingerprint, self.digest)

    def pack_slot(self, swa: Any, slot: int, fmt: str = "native", layers: int | None = None) -> bytes:
        return caches.pack_slot(swa, slot, self.fingerprint, self.digest, fmt=fmt, layers=layers)

    def save(self, pool: Any, saves: Sequence[tuple[int, bytes, str]]) -> None:
        """Snapshot newly published blocks for the store (no-op without one). A block the store
        is known to hold is not packed; with the queue full, blocks are dropped and counted."""
        if self.store is None or not saves:
            return
        items: list[SaveItem] = []
        dropped = 0
        for block, h, cls in saves:
            if self.store.is_known(h):
                continue
            if not self.store.has_room():
                dropped += 1
                continue
            items.append((h, self.pack_block(pool, block), cls))
        if dropped:
            self.store.count_dropped(dropped)
        self.store.save(items)
