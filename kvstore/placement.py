"""Deterministic placement of objects on groups of k+m storage nodes (rendezvous hashing).

Every client computes the same group for a key on every host: the score of a node for a
key is xxh3-64 over (node id, key), never Python's salted ``hash()``. The k+m nodes with
the highest scores form the group, in score order, so shard i goes to ``group[i]``. Adding
or removing a node moves only the shards that node wins or held. Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class NodeAddress:
    """A storage node: a stable id (used for placement) and where it listens."""

    node_id: str
    address: str  # host:port

    def __post_init__(self) -> None:
        if not self.node_id or "," in self.node_id:
            raise ValueError(f"node id {self.node_id!r} must be non-empty and contain no comma")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"node address {self.address!r} must be host:port")


def score(node_id: str, key: bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(node_id.encode() + b"\x00" + key))


def place(key: bytes, node_ids: Sequence[str], width: int) -> tuple[str, ...]:
    """The ``width`` node ids that hold ``key``'s shards, shard index order.

    Raises ValueError when there are fewer distinct nodes than ``width``.
    """
    unique = set(node_ids)
    if len(unique) < width:
        raise ValueError(f"placement needs {width} distinct nodes, have {len(unique)}")
    ranked = sorted(unique, key=lambda nid: (score(nid, key), nid), reverse=True)
    return tuple(ranked[:width])
