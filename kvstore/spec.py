"""The store spec: where a store's nodes listen and where its block directory lives.

One small JSON file, shared by every process that uses the same store (the engine's KV
connector, ``sluice store cluster --spec-out``, ``sluice serve --store``)::

    {
      "version": 1,
      "nodes": [{"id": "n00", "address": "127.0.0.1:7000"}, ...],
      "directory": "redis://127.0.0.1:6379/0",
      "codec": {"k": 10, "m": 2},
      "ttl_s": {"agent": 259200, "chat": 604800}
    }

``codec`` (default 10+2) and ``ttl_s`` (per traffic class, seconds; classes left out keep
``kvstore.retention.DEFAULT_TTL_S``) are optional. ``directory`` is a Redis URL
(``redis://``, ``rediss://`` or ``unix://``) or ``"memory"``: an in-process directory that
only the process that opened it sees, so ``memory`` suits a single process (tests, one
engine) and never a store shared by several processes or engine replicas.

Files are JSON only (no pickle, no YAML), at most ``MAX_SPEC_BYTES``, written atomically
(a temporary file in the same directory, then a rename) with mode 0600, since a Redis URL
may carry a password. Pure apart from ``load``/``save``: no sockets until
``open_store_client``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvstore.placement import NodeAddress
from kvstore.retention import DEFAULT_TTL_S
from kvstore.shardfmt import TRAFFIC_CLASSES

if TYPE_CHECKING:
    from kvstore.client import StoreClient

__all__ = ["MAX_SPEC_BYTES", "MEMORY", "StoreSpec", "open_store_client"]

MAX_SPEC_BYTES = 1 << 20
MEMORY = "memory"
SPEC_VERSION = 1
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_KEYS = {"version", "nodes", "directory", "codec", "ttl_s"}


def check_directory_url(url: str) -> None:
    """Raise ValueError unless ``url`` is ``memory`` or a usable Redis URL."""
    example = "'memory' or a Redis URL such as redis://127.0.0.1:6379/0"
    if url == MEMORY:
        return
    parts = urlsplit(url)
    if parts.scheme not in _REDIS_SCHEMES:
        raise ValueError(f"directory must be {example}, got {url!r}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"directory {url!r}: a unix:// URL needs a socket path (unix:///run/redis.sock)")
        return
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"directory {url!r}: the port must be a number within [0, 65535]") from None
    if not parts.hostname:
        raise ValueError(f"directory {url!r} names no host; expected {example}")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"directory {url!r}: the database after the host must be a number (/0), got {db!r}")


def redacted(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


@dataclass(frozen=True)
class StoreSpec:
    """The nodes of a store and its directory; see the module docstring for the file."""

    nodes: tuple[NodeAddress, ...]
    directory: str
    k: int = 10
    m: int = 2
    ttl_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "ttl_s", MappingProxyType(dict(self.ttl_s)))
        if not 1 <= self.k <= 32 or not 1 <= self.m <= 16:
            raise ValueError(f"codec {self.k}+{self.m}: need 1 <= k <= 32 and 1 <= m <= 16")
        counts = Counter(nd.node_id for nd in self.nodes)
        dups = sorted(nid for nid, n in counts.items() if n > 1)
        if dups:
            raise ValueError(f"node ids must be unique; repeated: {', '.join(dups)}")
        if len(self.nodes) < self.k + self.m:
            raise ValueError(
                f"a {self.k}+{self.m} code places each object on {self.k + self.m} distinct nodes, "
                f"but the spec lists {len(self.nodes)}; add nodes or choose a smaller code"
            )
        check_directory_url(self.directory)
        unknown = set(self.ttl_s) - set(TRAFFIC_CLASSES)
        if unknown:
            raise ValueError(
                f"ttl_s names unknown traffic classes {sorted(unknown)}; known: {sorted(TRAFFIC_CLASSES)}"
            )
        bad = {
            c: v
            for c, v in self.ttl_s.items()
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0
        }
        if bad:
            raise ValueError(f"ttl_s values must be positive seconds, got {bad}")

    @property
    def shared(self) -> bool:
        """Whether several processes can use this store together (a Redis directory)."""
        return self.directory != MEMORY

    def ttls(self) -> dict[str, float]:
        """The TTL of every traffic class: the spec's, else the default."""
        return {**DEFAULT_TTL_S, **{c: float(v) for c, v in self.ttl_s.items()}}

    def describe(self) -> str:
        """One line for logs (no password)."""
        return f"{len(self.nodes)} nodes, {self.k}+{self.m}, directory {redacted(self.directory)}"

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": SPEC_VERSION,
            "nodes": [{"id": nd.node_id, "address": nd.address} for nd in self.nodes],
            "directory": self.directory,
            "codec": {"k": self.k, "m": self.m},
        }
        if self.ttl_s:
            out["ttl_s"] = dict(self.ttl_s)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, doc: object) -> StoreSpec:
        if not isinstance(doc, dict):
            raise ValueError(f"a store spec is a JSON object, got {type(doc).__name__}")
        unknown = set(doc) - _KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; a store spec has {sorted(_KEYS)}")
        version = doc.get("version", SPEC_VERSION)
        if version != SPEC_VERSION:
            raise ValueError(
                f"store spec version {version!r} is not supported (this code reads {SPEC_VERSION})"
            )
        if "nodes" not in doc or "directory" not in doc:
            raise ValueError('a store spec needs "nodes" and "directory"')
        raw_nodes, directory = doc["nodes"], doc["directory"]
        if not isinstance(raw_nodes, list):
            raise ValueError('"nodes" must be a list of {"id": ..., "address": "host:port"}')
        nodes = []
        for i, nd in enumerate(raw_nodes):
            if not isinstance(nd, dict) or set(nd) != {"id", "address"}:
                raise ValueError(f'nodes[{i}] must be {{"id": ..., "address": "host:port"}}, got {nd!r}')
            if not isinstance(nd["id"], str) or not isinstance(nd["address"], str):
                raise ValueError(f"nodes[{i}]: id and address must be strings, got {nd!r}")
            try:
                nodes.append(NodeAddress(nd["id"], nd["address"]))
            except ValueError as exc:
                raise ValueError(f"nodes[{i}]: {exc}") from None
        if not isinstance(directory, str):
            raise ValueError(f'"directory" must be a string, got {directory!r}')
        codec = doc.get("codec", {})
        if not isinstance(codec, dict) or not set(codec) <= {"k", "m"}:
            raise ValueError(f'"codec" must be {{"k": 10, "m": 2}}, got {codec!r}')
        k, m = codec.get("k", 10), codec.get("m", 2)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (k, m)):
            raise ValueError(f'"codec" k and m must be integers, got {codec!r}')
        ttl = doc.get("ttl_s", {})
        if not isinstance(ttl, dict):
            raise ValueError(f'"ttl_s" must map traffic classes to seconds, got {ttl!r}')
        return cls(nodes=tuple(nodes), directory=directory, k=k, m=m, ttl_s=ttl)

    @classmethod
    def from_json(cls, text: str | bytes) -> StoreSpec:
        if len(text) > MAX_SPEC_BYTES:
            raise ValueError(f"store spec of {len(text)} bytes exceeds the limit of {MAX_SPEC_BYTES}")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        return cls.from_dict(doc)

    # -- files -----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> StoreSpec:
        """The spec in ``path``; ValueError (naming the file) when it is missing, too large
        or not a valid spec."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SPEC_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"store spec {path}: cannot read it: {exc.strerror or exc}") from None
        if len(data) > MAX_SPEC_BYTES:
            raise ValueError(f"store spec {path}: larger than the limit of {MAX_SPEC_BYTES} bytes")
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"store spec {path}: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write the spec to ``path`` atomically (readers see the old file or the new one)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def open_store_client(spec: StoreSpec, **overrides: Any) -> StoreClient:
    """A StoreClient of ``spec``'s nodes over its directory (a RedisDirectory for a URL, an
    InMemoryDirectory for ``memory``). ``overrides`` are StoreClientConfig fields (timeouts,
    ``background_repair``...). Opens no connection until the client is used."""
    from kvstore.client import StoreClient, StoreClientConfig
    from kvstore.codec import CodecConfig
    from kvstore.directory import Directory, InMemoryDirectory

    settings: dict[str, Any] = {"codec": CodecConfig(k=spec.k, m=spec.m), "ttl_s": spec.ttls(), **overrides}
    config = StoreClientConfig(nodes=spec.nodes, **settings)
    directory: Directory
    if spec.shared:
        from kvstore.redis_directory import RedisDirectory

        directory = RedisDirectory(spec.directory)
    else:
        directory = InMemoryDirectory()
    return StoreClient(config, directory)
