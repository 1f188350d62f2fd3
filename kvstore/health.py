"""Which storage nodes a client's reads route around (a per-node circuit breaker; pure).

A read asks for k shards first (``kvstore.fanout``). Asking a node that is down costs the
read a round trip: its shards fail, then the parity shards are asked for. So a node whose
stream failed (refused, unreachable, timed out) is *avoided* for a back-off period: reads
ask a parity shard on a live node in its place from the start, and a read with two nodes
down moves the same bytes as a healthy one. The back-off doubles from ``base_s`` with each
further failure, up to ``max_s``; once it has passed, the next read asks the node again
(a trial), and a node that answers anything (a shard or "not here") is healthy again.

Thread-safe; time comes from an injectable monotonic clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Breaker:
    failures: int = 0
    until: float = 0.0  # avoided until this time


class NodeHealth:
    def __init__(
        self, base_s: float = 1.0, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"back-off must satisfy 0 < base_s <= max_s, got {base_s} and {max_s}")
        self.base_s, self.max_s = base_s, max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, _Breaker] = {}

    def failed(self, node_id: str) -> None:
        """A stream to the node failed without an answer: avoid it for the next back-off."""
        with self._lock:
            b = self._nodes.setdefault(node_id, _Breaker())
            b.failures += 1
            b.until = self._clock() + min(self.max_s, self.base_s * 2 ** min(b.failures - 1, 30))

    def answered(self, node_id: str) -> None:
        """The node answered: it is healthy again."""
        if node_id in self._nodes:  # racy read; the pop below is what counts
            with self._lock:
                self._nodes.pop(node_id, None)

    def avoided(self) -> frozenset[str]:
        """The nodes to route around right now (their back-off has not passed)."""
        if not self._nodes:
            return frozenset()
        now = self._clock()
        with self._lock:
            return frozenset(n for n, b in self._nodes.items() if b.until > now)

    def failures(self, node_id: str) -> int:
        """Consecutive failed streams of the node (0 when healthy)."""
        with self._lock:
            b = self._nodes.get(node_id)
            return 0 if b is None else b.failures
