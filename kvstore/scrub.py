"""A node's scrubber: every shard file re-read and checked at a bounded rate.

Reads check each shard they serve, but a shard nobody reads (a parity shard under
data-first reads, a cold block) could rot unseen until the day it is needed, and a shard
in the hot cache is served from memory while its file rots. The scrubber re-reads every
shard *file* (never the cache) and checks it completely, as a read would
(``ShardStore.scrub_one``). A shard that fails is dropped from the node, with its cache
entry: readers then find it missing, decode from the others and the client's repair writes
it back.

One pass walks a snapshot of the node's shards, sleeping as needed to stay under
``bytes_per_s``; a pass starts every ``period_s`` (the first one ``first_after_s`` after
start, so a restarting node does not reread its disk at once). Pure: no sockets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.shardstore import ShardStore

log = logging.getLogger(__name__)


@dataclass
class ScrubStats:
    passes: int = 0  # passes completed
    shards: int = 0  # shards checked, over all passes
    bytes: int = 0  # file bytes read
    corrupt: int = 0  # shards that failed and were dropped


class Scrubber:
    def __init__(
        self,
        store: ShardStore,
        bytes_per_s: float,
        period_s: float,
        wait: Callable[[float], bool],
        first_after_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``wait(seconds)`` sleeps and returns True when the scrubber must stop (a
        ``threading.Event().wait``)."""
        if bytes_per_s <= 0 or period_s <= 0 or first_after_s < 0:
            raise ValueError(
                f"scrub rate and period must be positive, first pass delay >= 0; got {bytes_per_s} B/s, "
                f"{period_s} s, {first_after_s} s"
            )
        self.store, self.bytes_per_s, self.period_s = store, bytes_per_s, period_s
        self.first_after_s = first_after_s
        self._wait, self._clock = wait, clock
        self.stats = ScrubStats()

    def run_pass(self) -> bool:
        """Check every shard the node holds now; False when told to stop midway."""
        start, read = self._clock(), 0
        for name in self.store.names():
            result = self.store.scrub_one(name)
            if result is None:  # deleted, expired or evicted since the snapshot
                continue
            size, ok = result
            read += size
            self.stats.shards += 1
            self.stats.bytes += size
            if not ok:
                self.stats.corrupt += 1
                log.warning("scrub: shard %s failed its checks and was dropped", name)
            ahead = read / self.bytes_per_s - (self._clock() - start)
            if ahead > 0.001 and self._wait(ahead):  # no sleeps of microseconds
                return False
        self.stats.passes += 1
        return True

    def loop(self) -> None:
        """Passes every ``period_s`` until ``wait`` says stop (a thread's target)."""
        if self._wait(min(self.first_after_s, self.period_s)):
            return
        while True:
            began = self._clock()
            if not self.run_pass():
                return
            if self._wait(max(0.0, self.period_s - (self._clock() - began))):
                return
