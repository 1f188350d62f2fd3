"""API-key checking: constant time, no early exit, either header spelling.

OpenAI clients send ``Authorization: Bearer <key>``; Anthropic clients send
``x-api-key: <key>``. Both are accepted on every endpoint. The presented key is compared
with *every* configured key through ``hmac.compare_digest`` and the results are OR-ed, so
the time taken does not reveal which key (or how much of one) matched
(GHSA-wr9h-g72x-mwhm was an early-exit ``==``).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from services.api.errors import ApiError

OPEN_PATHS = frozenset({"/health"})


class KeyChecker:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def matches(self, presented: str) -> bool:
        given = presented.encode()
        ok = False
        for key in self._keys:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, key)
        return ok

    def check(self, path: str, headers: Mapping[str, str]) -> None:
        """Raise ``ApiError(401)`` unless auth is off, the path is open, or a key matches."""
        if not self._keys or path in OPEN_PATHS:
            return
        presented = presented_key(headers)
        if presented is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                param="api_key",
                code="missing_api_key",
            )
        if not self.matches(presented):
            raise ApiError(401, "invalid API key", param="api_key", code="invalid_api_key")


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    if key is not None and key.strip():
        return key.strip()
    return None
