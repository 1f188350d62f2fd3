"""Storage-side retention: TTL per traffic class and an LRU collector past a high watermark.

``ShardIndex`` is the in-memory view a node keeps of its shards (size, class, last access);
it answers which shards to evict to get back under the low watermark and which have
expired. It only decides; the caller deletes files. Pure: no disk, no sockets, no clock
(times are passed in).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.shardfmt import CLASS_NAMES, TRAFFIC_CLASSES

DAY_S = 86400.0
DEFAULT_TTL_S: Mapping[str, float] = MappingProxyType({"agent": 3 * DAY_S, "chat": 7 * DAY_S})


@dataclass(frozen=True)
class RetentionConfig:
    """TTL per traffic class (seconds since last access) and the LRU watermarks (fractions)."""

    ttl_s: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TTL_S)
    high_watermark: float = 0.90
    low_watermark: float = 0.80

    def __post_init__(self) -> None:
        unknown = set(self.ttl_s) - set(TRAFFIC_CLASSES)
        if unknown:
            raise ValueError(
                f"TTL for unknown traffic classes {sorted(unknown)}; known: {sorted(TRAFFIC_CLASSES)}"
            )
        missing = set(TRAFFIC_CLASSES) - set(self.ttl_s)
        if missing:
            raise ValueError(f"no TTL given for traffic classes {sorted(missing)}")
        if any(v <= 0 for v in self.ttl_s.values()):
            raise ValueError(f"TTLs must be positive seconds, got {dict(self.ttl_s)}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ValueError(
                f"watermarks need 0 < low < high <= 1, got low={self.low_watermark} high={self.high_watermark}"
            )
        object.__setattr__(self, "ttl_s", MappingProxyType(dict(self.ttl_s)))

    def ttl_for(self, class_code: int) -> float:
        """TTL of a header class code; an unknown code gets the shortest TTL."""
        name = CLASS_NAMES.get(class_code)
        return self.ttl_s[name] if name is not None else min(self.ttl_s.values())


@dataclass
class IndexEntry:
    size: int
    traffic_class: int
    last_access: float


class ShardIndex:
    """Shards by name in LRU order (least recently used first) with the bytes they use."""

    def __init__(self, capacity_bytes: int, config: RetentionConfig) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.config = config
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> IndexEntry | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        """Every shard's name, least recently used first."""
        return list(self._entries)

    def add(self, name: str, size: int, traffic_class: int, now: float) -> None:
        """Insert or replace ``name`` as the most recently used entry."""
        self.remove(name)
        self._entries[name] = IndexEntry(size, traffic_class, now)
        self.used += size

    def touch(self, name: str, now: float) -> bool:
        entry = self._entries.get(name)
        if entry is None:
            return False
        entry.last_access = max(entry.last_access, now)
        self._entries.move_to_end(name)
        return True

    def remove(self, name: str) -> IndexEntry | None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.used -= entry.size
        return entry

    def expires_at(self, name: str) -> float | None:
        entry = self._entries.get(name)
        return None if entry is None else entry.last_access + self.config.ttl_for(entry.traffic_class)

    def is_expired(self, name: str, now: float) -> bool:
        at = self.expires_at(name)
        return at is not None and at <= now

    def over_high_watermark(self, incoming: int = 0) -> bool:
        return self.used + incoming > self.config.high_watermark * self.capacity

    def eviction_candidates(self, incoming: int = 0) -> list[str]:
        """LRU names to drop so that used + incoming <= low watermark; empty if under high."""
        if not self.over_high_watermark(incoming):
            return []
        goal = self.config.low_watermark * self.capacity - incoming
        out, used = [], self.used
        for name, entry in self._entries.items():
            if used <= goal:
                break
            out.append(name)
            used -= entry.size
        return out

    def expired(self, now: float) -> list[str]:
        return [n for n in self._entries if self.is_expired(n, now)]
