"""A store node's Prometheus metrics: shard operations and bytes, usage, LRU/TTL, checksum
failures, the hot cache and the scrubber. Counters are bound once per label set; gauges
read the store's own counters when scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.scrub import Scrubber
from kvstore.shardstore import ShardStore


class NodeMetrics:
    """The node's Prometheus metrics, in a registry of its own (served by ``--metrics-port``)."""

    def __init__(self, store: ShardStore, node_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ops = Counter(
            "sluice_store_ops", "Shard operations by kind and outcome", ["op", "outcome"], registry=r
        )
        moved = Counter("sluice_store_bytes", "Shard bytes moved by direction", ["direction"], registry=r)
        # Children bound once: a labels() lookup per shard costs more than the increment.
        self.puts_ok, self.puts_rejected = ops.labels("put", "ok"), ops.labels("put", "rejected")
        self.puts_too_large = ops.labels("put", "too_large")
        self.gets_ok, self.gets_not_found = ops.labels("get", "ok"), ops.labels("get", "not_found")
        self.gets_corrupt = ops.labels("get", "corrupt")
        self.bytes_in, self.bytes_out = moved.labels("in"), moved.labels("out")
        used = Gauge("sluice_store_used_bytes", "Bytes of shards on disk", registry=r)
        used.set_function(lambda: store.index.used)
        Gauge("sluice_store_capacity_bytes", "Configured capacity", registry=r).set(store.index.capacity)
        Gauge("sluice_store_shards", "Shards on disk", registry=r).set_function(lambda: len(store.index))
        Gauge("sluice_store_evicted_shards", "Evicted by LRU since start", registry=r).set_function(
            lambda: store.evicted
        )
        Gauge("sluice_store_expired_shards", "Expired by TTL since start", registry=r).set_function(
            lambda: store.expired
        )
        Gauge("sluice_store_corrupt_shards", "Failed checksum on read since start", registry=r).set_function(
            lambda: store.corrupt_detected
        )
        Gauge("sluice_store_cache_bytes", "Bytes in the hot cache of read shards", registry=r).set_function(
            lambda: store.cache.used
        )
        Gauge("sluice_store_cache_hits", "Reads served by the hot cache", registry=r).set_function(
            lambda: store.cache.hits
        )
        Gauge("sluice_store_cache_misses", "Reads that went to a shard file", registry=r).set_function(
            lambda: store.cache.misses
        )

    def watch_scrubber(self, scrubber: Scrubber) -> None:
        r, st = self.registry, scrubber.stats
        Gauge("sluice_store_scrub_passes", "Scrub passes completed", registry=r).set_function(
            lambda: st.passes
        )
        Gauge(
            "sluice_store_scrub_bytes", "Shard file bytes re-read by the scrubber", registry=r
        ).set_function(lambda: st.bytes)
        Gauge(
            "sluice_store_scrub_corrupt_shards", "Shards the scrubber found bad and dropped", registry=r
        ).set_function(lambda: st.corrupt)
