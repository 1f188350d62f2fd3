"""A request's traffic class ("agent" or "chat"): from its API key, else a header, else "chat".

The KV store keeps blocks for a time that depends on the class that wrote them
(``kvstore.shardfmt.TRAFFIC_CLASSES``), and the engine tags every block it writes with its
request's class. The API decides the class once per request:

1. the class configured on the API key the request presented, if that key has one;
2. else the ``X-Sluice-Traffic-Class`` header (``agent`` or ``chat``, case-insensitive);
3. else ``chat``.

A key with a class wins over the header, so a client cannot give its blocks another TTL
class than its key's. The header is validated even then: a value outside the set is a 400.

Keys are configured as before (``SLUICE_API_KEYS``, comma-separated, or
``SLUICE_API_KEYS_FILE``, one per line), each entry either ``KEY`` (no class: the header
decides) or ``KEY:CLASS``. The text after the entry's last ``:`` must be a known class, so a
key that itself contains ``:`` is written with its class, e.g. ``a:b:chat``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.shardfmt import TRAFFIC_CLASSES
from services.api.errors import ApiError

DEFAULT_TRAFFIC_CLASS = "chat"
TRAFFIC_CLASS_HEADER = "x-sluice-traffic-class"  # lower case, as ASGI delivers header names
HEADER_DISPLAY = "X-Sluice-Traffic-Class"
STATE_KEY = "sluice_key_traffic_class"  # set in the ASGI scope's "state" by the guard middleware


def allowed_classes() -> str:
    return ", ".join(sorted(TRAFFIC_CLASSES))


@dataclass(frozen=True)
class ApiKey:
    """One configured key and its traffic class (None: the request's header decides)."""

    key: str
    traffic_class: str | None = None

    def __repr__(self) -> str:  # keys never appear in logs or reprs
        return f"ApiKey(key=<{len(self.key)} chars>, traffic_class={self.traffic_class!r})"


def parse_key_entry(entry: str) -> ApiKey:
    """``KEY`` or ``KEY:CLASS``; ValueError for an empty key or an unknown class."""
    entry = entry.strip()
    key, sep, cls = entry.rpartition(":")
    if not sep:
        key, cls = entry, ""
    key, cls = key.strip(), cls.strip()
    if sep and cls not in TRAFFIC_CLASSES:
        raise ValueError(
            f"API key entry ends in ':{cls}', but the text after the last ':' names the key's traffic "
            f"class, one of {allowed_classes()} (write KEY or KEY:CLASS)"
        )
    if not key:
        raise ValueError("API key entries must not be empty (write KEY or KEY:CLASS)")
    return ApiKey(key, cls if sep else None)


def parse_api_keys(entries: Iterable[str]) -> tuple[ApiKey, ...]:
    """Every entry parsed; one key configured twice with different classes is a ValueError."""
    keys = tuple(parse_key_entry(e) for e in entries)
    classes: dict[str, str | None] = {}
    for k in keys:
        if classes.setdefault(k.key, k.traffic_class) != k.traffic_class:
            raise ValueError("an API key is configured twice with different traffic classes")
    return tuple(dict.fromkeys(keys))


def resolve_traffic_class(header: str | None, key_class: str | None) -> str:
    """The request's class: the key's, else the header's, else ``chat``; a bad header is a 400."""
    from_header = None
    if header is not None:
        from_header = header.strip().lower()
        if from_header not in TRAFFIC_CLASSES:
            raise ApiError(
                400,
                f"{HEADER_DISPLAY} must be one of {allowed_classes()}, got {header.strip()!r}",
                param=TRAFFIC_CLASS_HEADER,
                code="invalid_traffic_class",
            )
    return key_class or from_header or DEFAULT_TRAFFIC_CLASS
