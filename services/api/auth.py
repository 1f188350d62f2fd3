"""API-key checking: constant time, no early exit, either header spelling.

OpenAI clients send ``Authorization: Bearer <key>``; Anthropic clients send
``x-api-key: <key>``. Both are accepted on every endpoint. The presented key is compared
with *every* configured key through ``hmac.compare_digest`` and the results are OR-ed, so
the time taken does not reveal which key (or how much of one) matched
(GHSA-wr9h-g72x-mwhm was an early-exit ``==``).

A configured key may carry a traffic class (``KEY:agent``, ``services.api.traffic_class``);
``check`` returns the matched key's class, which the guard middleware hands to the route.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from services.api.errors import ApiError
from services.api.traffic_class import parse_api_keys

OPEN_PATHS = frozenset({"/health"})
# the operator endpoints check their own keys (ApiConfig.admin_keys, services/api/admin.py)
ADMIN_PREFIX = "/admin/"


class KeyChecker:
    def __init__(self, keys: Sequence[str]) -> None:
        """``keys``: configured entries, ``KEY`` or ``KEY:CLASS`` (ValueError when malformed)."""
        self._keys = tuple((k.key.encode(), k.traffic_class) for k in parse_api_keys(keys))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _match(self, presented: str) -> tuple[bool, str | None]:
        given = presented.encode()
        ok = False
        cls: str | None = None
        for key, key_class in self._keys:  # no early exit: every key is compared
            hit = hmac.compare_digest(given, key)
            ok |= hit
            cls = key_class if hit else cls
        return ok, cls

    def matches(self, presented: str) -> bool:
        return self._match(presented)[0]

    def check(self, path: str, headers: Mapping[str, str]) -> str | None:
        """Raise ``ApiError(401)`` unless auth is off, the path is open (or an operator path,
        which checks the admin keys itself), or a key matches.

        Returns the matched key's traffic class (None: no class on the key, or no key needed).
        """
        if not self._keys or path in OPEN_PATHS or path.startswith(ADMIN_PREFIX):
            return None
        presented = presented_key(headers)
        if presented is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                param="api_key",
                code="missing_api_key",
            )
        ok, key_class = self._match(presented)
        if not ok:
            raise ApiError(401, "invalid API key", param="api_key", code="invalid_api_key")
        return key_class


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
