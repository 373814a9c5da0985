"""The store's Prometheus metrics (prefix `deepinfer_kvstore_`), in a registry of their own per store.

Per traffic class: blocks looked up and blocks hit (the hit rate is their ratio; `hit_rate` is exported too),
loads (requests served from the store), bytes stored (a gauge refreshed by `KVStore.stats`) and expirations;
and for the store as a whole: bytes written, evictions, corrupt blocks, dropped writes and degraded lookups
(the store down or slower than its lookup timeout).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

HEALTH_STATS = {
    "kvstore_bytes": "KV store: bytes of blocks stored (the store the instance uses; instances sharing one report "
                     "the same figure)",
    "kvstore_lookup_blocks_total": "KV store: prompt blocks the instance looked up",
    "kvstore_hit_blocks_total": "KV store: prompt blocks the instance loaded from the store",
    "kvstore_loads_total": "KV store: requests whose prefix the instance loaded from the store",
    "kvstore_written_bytes_total": "KV store: bytes of blocks the instance wrote",
    "kvstore_evictions_total": "KV store: blocks the instance evicted under capacity pressure (LRU)",
    "kvstore_expirations_total": "KV store: blocks the instance's sweeper removed (TTL passed)",
    "kvstore_corrupt_blocks_total": "KV store: blocks the instance refused (checksum, truncation, key) and deleted",
    "kvstore_dropped_writes_total": "KV store: blocks the instance did not write (queue full, store down)",
    "kvstore_degraded_lookups_total": "KV store: lookups the instance answered as misses (store down or slow)",
    "kvstore_conversation_blocks_saved_total": "KV store: blocks of finished conversation turns the decode instance "
                                               "queued for the store",
}
"""Flat store figures of a worker's Health stats (`KVStore.health_stats`), by name: what the HTTP front exports per
instance (`deepinfer_stage_<name>{stage,instance}`)."""

CLASS_STATS = {
    "hit_rate": "KV store: hit blocks over looked-up blocks on the instance, by traffic class",
    "lookup_blocks": "KV store: prompt blocks the instance looked up, by traffic class",
    "hit_blocks": "KV store: prompt blocks the instance loaded from the store, by traffic class",
    "loads": "KV store: requests whose prefix the instance loaded from the store, by traffic class",
    "expirations": "KV store: blocks the instance's sweeper removed (TTL passed), by traffic class",
    "stored_blocks": "KV store: blocks stored, by traffic class (the store's; as its sweeper last read it)",
    "stored_bytes": "KV store: bytes stored, by traffic class (the store's; as its sweeper last read it)",
}
"""Per-class figures of a worker's Health stats (`kvstore_classes[class][name]`), exported by the HTTP front as
`deepinfer_stage_kvstore_class_<name>{stage,instance,traffic_class}`."""


class KVStoreMetrics:
    """Counters and gauges of one `KVStore`, with plain-number mirrors for `stats()` and tests."""

    def __init__(self, backend: str) -> None:
        self.registry = CollectorRegistry()
        r, b = self.registry, backend
        cls = ["backend", "traffic_class"]
        self._lookup = Counter("deepinfer_kvstore_lookup_blocks", "Prompt blocks looked up in the store", cls, registry=r)
        self._hit = Counter("deepinfer_kvstore_hit_blocks", "Prompt blocks served from the store", cls, registry=r)
        self._hit_rate = Gauge("deepinfer_kvstore_hit_rate", "Hit blocks over looked-up blocks", cls, registry=r)
        self._loads = Counter("deepinfer_kvstore_loads", "Requests whose prefix was loaded from the store", cls,
                              registry=r)
        self._stored = Gauge("deepinfer_kvstore_stored_bytes", "Bytes of blocks in the store", cls, registry=r)
        self._expired = Counter("deepinfer_kvstore_expirations", "Blocks removed by the sweeper (TTL passed)", cls,
                                registry=r)
        self._written = Counter("deepinfer_kvstore_written_bytes", "Bytes of blocks written", ["backend"], registry=r)
        self._evicted = Counter("deepinfer_kvstore_evictions", "Blocks evicted under capacity pressure (LRU)",
                                ["backend"], registry=r)
        self._corrupt = Counter("deepinfer_kvstore_corrupt_blocks", "Blocks refused (checksum, truncation, key) "
                                "and deleted", ["backend"], registry=r)
        self._dropped = Counter("deepinfer_kvstore_dropped_writes", "Blocks not written (queue full, store down)",
                                ["backend"], registry=r)
        self._degraded = Counter("deepinfer_kvstore_degraded_lookups", "Lookups answered as misses because the "
                                 "store was down or slow", ["backend", "reason"], registry=r)
        self.backend = b
        self.lookup_blocks: dict[str, int] = {}
        self.hit_blocks: dict[str, int] = {}
        self.loads: dict[str, int] = {}
        self.expirations: dict[str, int] = {}
        self.written_bytes = 0
        self.evictions = 0
        self.corrupt_blocks = 0
        self.dropped_writes = 0
        self.degraded: dict[str, int] = {}

    def lookup(self, traffic_class: str, num_blocks: int, num_hit: int) -> None:
        self.lookup_blocks[traffic_class] = self.lookup_blocks.get(traffic_class, 0) + num_blocks
        self.hit_blocks[traffic_class] = self.hit_blocks.get(traffic_class, 0) + num_hit
        self._lookup.labels(self.backend, traffic_class).inc(num_blocks)
        self._hit.labels(self.backend, traffic_class).inc(num_hit)
        self._hit_rate.labels(self.backend, traffic_class).set(self.hit_rate(traffic_class))
        if num_hit:
            self.loads[traffic_class] = self.loads.get(traffic_class, 0) + 1
            self._loads.labels(self.backend, traffic_class).inc()

    def hit_rate(self, traffic_class: str) -> float:
        n = self.lookup_blocks.get(traffic_class, 0)
        return self.hit_blocks.get(traffic_class, 0) / n if n else 0.0

    def expired(self, traffic_class: str) -> None:
        self.expirations[traffic_class] = self.expirations.get(traffic_class, 0) + 1
        self._expired.labels(self.backend, traffic_class).inc()

    def written(self, nbytes: int) -> None:
        self.written_bytes += nbytes
        self._written.labels(self.backend).inc(nbytes)

    def evicted(self, n: int = 1) -> None:
        self.evictions += n
        self._evicted.labels(self.backend).inc(n)

    def corrupt(self) -> None:
        self.corrupt_blocks += 1
        self._corrupt.labels(self.backend).inc()

    def dropped(self, n: int = 1) -> None:
        self.dropped_writes += n
        self._dropped.labels(self.backend).inc(n)

    def degrade(self, reason: str) -> None:
        self.degraded[reason] = self.degraded.get(reason, 0) + 1
        self._degraded.labels(self.backend, reason).inc()

    def set_stored(self, by_class: dict[str, tuple[int, int]]) -> None:
        for c, (_, nbytes) in by_class.items():
            self._stored.labels(self.backend, c).set(nbytes)

    def render(self) -> bytes:
        """The Prometheus text exposition of this store's metrics."""
        return generate_latest(self.registry)
