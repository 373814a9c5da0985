"""`KVStore`: stored blocks keyed by prefix-chain keys, with TTL by traffic class, LRU eviction, integrity
checks, bounded lookups and metrics, over any `BlobBackend`.

Writes go through a background writer thread (`put_async`: a bounded queue, dropped and counted when full,
never waited for); reads are `load_prefix` (the longest prefix of a key chain whose blocks all pass their
checks), and the connector calls it through `load_prefix_bounded`, which answers a miss when the store is
down or slower than `lookup_timeout_s` and then leaves the backend alone for `backoff_s` (a degraded store
costs requests nothing but their hits). A sweeper thread removes expired entries every `sweep_interval_s` and
reads the bytes stored per class every `STATS_REFRESH_S` (for `health_stats`, what workers export).

TTL: an entry expires `ttl(class)` seconds after its last write or hit (a hit restarts it; the longer of
two classes' expiries wins). Capacity: once the stored bytes pass `high_watermark * capacity_bytes`, the
least recently used entries are evicted down to `low_watermark * capacity_bytes`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from deepinfer.kvstore import block_format
from deepinfer.kvstore.backends import BlobBackend, StoreUnavailable, make_backend
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.kvstore.index import StoreIndex
from deepinfer.kvstore.metrics import KVStoreMetrics

logger = logging.getLogger("deepinfer.kvstore")

INDEX_NAME = "index.sqlite"

STATS_REFRESH_S = 10.0
"""Seconds between the sweeper thread's reads of the bytes stored per class (an index scan, kept off the
serving threads: `health_stats` reports the last reading)."""


class KVStore:
    """The persistent compressed-KV store over one backend (see the module docstring)."""

    def __init__(self, config: KVStoreConfig | None = None, backend: BlobBackend | None = None, *,
                 clock: Callable[[], float] = time.time, start_threads: bool = True, backoff_s: float = 5.0) -> None:
        """`clock`: wall-clock seconds (tests pass one they advance). `start_threads`: run the writer and the
        sweeper (False: `put_async` writes inline and sweeps happen only by `sweep()`; for tests and tools)."""
        self.config = config or KVStoreConfig()
        self.backend = backend or make_backend(self.config)
        self.clock = clock
        self.backoff_s = backoff_s
        # NOTE: one index file per backend, so an embedded store and a Mooncake index in one directory never mix
        name = INDEX_NAME if self.backend.name == "embedded" else f"index-{self.backend.name}.sqlite"
        self.index = StoreIndex(os.path.join(self.config.dirs[0], name))
        self.metrics = KVStoreMetrics(self.backend.name)
        self._bytes = self.index.total_bytes()  # estimate; eviction re-reads the index
        self._ref_bytes = self.index.bytes_by_ref()  # per directory (embedded): where new blocks go
        self._bytes_lock = threading.Lock()
        self._down_until = 0.0  # monotonic time before which lookups skip the backend (it failed or was slow)
        self._stored_by_class: dict[str, tuple[int, int]] = {}  # class -> (blocks, bytes), as last read (sweeper)
        self._readers = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-read")
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if start_threads:
            self._queue = queue.Queue(maxsize=self.config.max_pending_writes)
            self._threads = [threading.Thread(target=self._writer, name="kvstore-writer", daemon=True),
                             threading.Thread(target=self._sweeper, name="kvstore-sweeper", daemon=True)]
            for t in self._threads:
                t.start()

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, parent_key: bytes | None, payload: bytes | memoryview, traffic_class: str | None = None) -> bool:
        """Blocks until the block is written and indexed; False (logged, counted) when the backend fails."""
        cls = self.config.class_of(traffic_class)
        ttl = self.config.ttl_s(cls)
        k = key.hex()
        blob = block_format.encode(key, parent_key, payload)
        with self._bytes_lock:
            ref = self.backend.choose_ref(len(blob), self._ref_bytes)
        try:
            self.backend.write(k, ref, blob, ttl_s=ttl)
        except StoreUnavailable as e:
            logger.warning("KV store write failed (the block is dropped): %s", e)
            self.metrics.dropped()
            return False
        self.index.put(k, ref, len(blob), cls, self.clock(), ttl)
        self.metrics.written(len(blob))
        with self._bytes_lock:
            self._bytes += len(blob)
            self._ref_bytes[ref] = self._ref_bytes.get(ref, 0) + len(blob)
            over = self._bytes > self.config.high_watermark * self.config.capacity_bytes
        if over:
            self.evict_to_watermark()
        return True

    def put_async(self, blocks: list[tuple[bytes, bytes | None, bytes]], traffic_class: str | None = None) -> int:
        """Queue `(key, parent_key, payload)` blocks for the writer; returns how many were queued (the rest are
        dropped and counted: a full queue never makes the caller wait). Without threads: writes inline."""
        if self._queue is None:
            return sum(self.put(k, p, d, traffic_class) for k, p, d in blocks)
        n = 0
        for i, (k, p, d) in enumerate(blocks):
            try:
                self._queue.put_nowait((k, p, d, traffic_class))
                n += 1
            except queue.Full:
                self.metrics.dropped(len(blocks) - i)
                break
        return n

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Blocks until every queued write is done (True) or `timeout_s` passed (False)."""
        if self._queue is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _writer(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                k, p, d, cls = item
                if k.hex() in self.index.present([k.hex()], self.clock()):
                    self.index.touch([k.hex()], self.config.class_of(cls), self.clock(), self.config.ttl_s(cls))
                else:
                    self.put(k, p, d, cls)
            except Exception:
                logger.exception("KV store writer failed on a block (dropped)")
                self.metrics.dropped()
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------ reads

    def stored_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys of a chain the store holds now (unexpired; no TTL refresh, no checks)."""
        if not keys:
            return 0
        hexes = [k.hex() for k in keys]
        found = self.index.present(hexes, self.clock())
        n = 0
        while n < len(hexes) and hexes[n] in found:
            n += 1
        if n < len(hexes) and self.backend.is_shared and not self.index.present([hexes[n]], float("-inf")):
            # written elsewhere (another machine's index); an entry our index holds but expired stays a miss
            for exists in self.backend.exists(hexes[n:]):
                if not exists:
                    break
                n += 1
        return n

    def get(self, key: bytes, parent_key: bytes | None) -> memoryview | None:
        """Blocks on the backend: the block's payload if it is stored and passes every check; a corrupt,
        truncated or mismatched block is deleted and counted, and None is returned (a miss)."""
        k = key.hex()
        entry = self.index.get(k)
        blob = self.backend.read(k, entry.ref if entry else "")
        if blob is None:
            if entry is not None:
                self.index.remove(k)  # the backend lost it (evicted by Mooncake, deleted by hand)
            return None
        payload, why = block_format.decode(blob, key, parent_key)
        if payload is None:
            logger.warning("KV store block %s refused and deleted: %s", k, why)
            self.metrics.corrupt()
            self._remove(k, entry.ref if entry else "")
            return None
        return payload

    def load_prefix(self, keys: list[bytes], traffic_class: str | None = None) -> list[memoryview]:
        """Blocks on the backend: the payloads of the longest prefix of `keys` whose blocks are all stored and
        valid (a bad block ends the prefix there). Hits restart their TTL; counts the lookup per class."""
        cls = self.config.class_of(traffic_class)
        n = self.stored_prefix(keys)
        payloads: list[memoryview] = []
        parent = None
        for key in keys[:n]:
            payload = self.get(key, parent)
            if payload is None:
                break
            payloads.append(payload)
            parent = key
        if payloads:
            now, ttl = self.clock(), self.config.ttl_s(cls)
            hexes = [k.hex() for k in keys[:len(payloads)]]
            known = self.index.present(hexes, float("-inf"))
            for k, p in zip(keys[:len(payloads)], payloads):
                if k.hex() not in known:  # written by another machine (shared backend): index it here
                    self.index.put(k.hex(), "", p.nbytes + block_format.HEADER_NBYTES, cls, now, ttl)
            self.index.touch(hexes, cls, now, ttl)
        self.metrics.lookup(cls, len(keys), len(payloads))
        return payloads

    def load_prefix_bounded(self, keys: list[bytes], traffic_class: str | None = None,
                            timeout_s: float | None = None) -> list[memoryview]:
        """Blocks at most `timeout_s` (default `lookup_timeout_s`): `load_prefix`, or no payloads (a miss, logged
        and counted as degraded) when the backend fails or is slower; then the backend is skipped for
        `backoff_s`, so a store that is down costs later requests nothing."""
        cls = self.config.class_of(traffic_class)
        if not keys:
            return []
        if time.monotonic() < self._down_until:
            self.metrics.degrade("backing_off")
            self.metrics.lookup(cls, len(keys), 0)
            return []
        fut = self._readers.submit(self.load_prefix, keys, traffic_class)
        try:
            return fut.result(timeout=self.config.lookup_timeout_s if timeout_s is None else timeout_s)
        except cf.TimeoutError:
            reason = "timeout"
            logger.warning("KV store lookup took longer than %.3f s: served as a miss; backing off %.1f s",
                           self.config.lookup_timeout_s if timeout_s is None else timeout_s, self.backoff_s)
        except StoreUnavailable as e:
            reason = "unavailable"
            logger.warning("KV store unavailable (%s): served as a miss; backing off %.1f s", e, self.backoff_s)
        except Exception:
            reason = "error"
            logger.exception("KV store lookup failed: served as a miss")
        self._down_until = time.monotonic() + self.backoff_s
        self.metrics.degrade(reason)
        self.metrics.lookup(cls, len(keys), 0)
        return []

    # ------------------------------------------------------------------ expiry and eviction

    def _remove(self, key: str, ref: str) -> None:
        entry = self.index.remove(key)
        self.backend.delete(key, entry.ref if entry else ref)
        if entry is not None:
            with self._bytes_lock:
                self._bytes -= entry.nbytes
                self._ref_bytes[entry.ref] = self._ref_bytes.get(entry.ref, 0) - entry.nbytes

    def sweep(self, now: float | None = None) -> int:
        """Remove every entry whose TTL has passed (counted per class); returns how many."""
        now = self.clock() if now is None else now
        n = 0
        while True:
            batch = self.index.expired(now)
            if not batch:
                break
            for e in batch:
                self._remove(e.key, e.ref)
                self.metrics.expired(e.traffic_class)
                n += 1
        self.backend.retry_deletes()
        return n

    def evict_to_watermark(self) -> int:
        """Past the high watermark: evict least recently used entries down to the low one; returns how many."""
        cap = self.config.capacity_bytes
        total = self.index.total_bytes()
        with self._bytes_lock:
            self._bytes = total
            self._ref_bytes = self.index.bytes_by_ref()
        if total <= self.config.high_watermark * cap:
            return 0
        target = self.config.low_watermark * cap
        n = 0
        while total > target:
            victims = self.index.least_recently_used(64)
            if not victims:
                break
            for e in victims:
                if total <= target:
                    break
                self._remove(e.key, e.ref)
                total -= e.nbytes
                n += 1
        self.metrics.evicted(n)
        return n

    def evict(self, num_bytes: int) -> int:
        """Evict least recently used entries until `num_bytes` are freed (`deepinfer store evict`); how many."""
        freed, n = 0, 0
        while freed < num_bytes:
            victims = self.index.least_recently_used(64)
            if not victims:
                break
            for e in victims:
                if freed >= num_bytes:
                    break
                self._remove(e.key, e.ref)
                freed += e.nbytes
                n += 1
        self.metrics.evicted(n)
        return n

    def clear(self) -> int:
        """Remove every entry; returns how many."""
        rows = self.index.clear()
        for e in rows:
            self.backend.delete(e.key, e.ref)
        with self._bytes_lock:
            self._bytes = 0
            self._ref_bytes = {}
        return len(rows)

    def remove_orphans(self, min_age_s: float = 600.0) -> int:
        """Delete block files no index row lists, older than `min_age_s` (a crash between writing a file and
        indexing it); embedded backend only. Returns how many."""
        remove = getattr(self.backend, "remove_orphans", None)
        if remove is None:
            return 0
        known = {e.key for e in self.index.least_recently_used(1 << 62)}
        return remove(known, min_age_s)

    def _sweeper(self) -> None:
        try:
            self.remove_orphans()
        except Exception:
            logger.exception("KV store orphan cleanup failed")
        next_sweep = time.monotonic() + self.config.sweep_interval_s
        while True:
            try:
                self.refresh_stored()
            except Exception:
                logger.exception("KV store stats refresh failed")
            if self._stop.wait(max(0.0, min(STATS_REFRESH_S, next_sweep - time.monotonic()))):
                return
            if time.monotonic() < next_sweep:
                continue
            next_sweep = time.monotonic() + self.config.sweep_interval_s
            try:
                self.sweep()
                self.evict_to_watermark()  # other processes sharing the index write too
            except Exception:
                logger.exception("KV store sweep failed")

    # ------------------------------------------------------------------ introspection

    def refresh_stored(self) -> dict[str, tuple[int, int]]:
        """Blocks on an index scan: the blocks and bytes stored per class now (also the `stored_bytes` gauge
        and what `health_stats` reports until the next refresh)."""
        by_class = self.index.stats_by_class()
        self._stored_by_class = by_class
        self.metrics.set_stored(by_class)
        return by_class

    def stats(self) -> dict:
        """Blocks and bytes per class, capacity, and the hit / load / eviction / expiry counts so far."""
        by_class = self.refresh_stored()
        m = self.metrics
        return {
            "backend": self.backend.name,
            "blocks": sum(n for n, _ in by_class.values()),
            "bytes": sum(b for _, b in by_class.values()),
            "capacity_bytes": self.config.capacity_bytes,
            "classes": {c: {"blocks": n, "bytes": b, "ttl_s": self.config.ttl_s(c),
                            "hit_rate": m.hit_rate(c), "loads": m.loads.get(c, 0),
                            "expirations": m.expirations.get(c, 0)} for c, (n, b) in sorted(by_class.items())},
            "hit_rate": {c: m.hit_rate(c) for c in sorted(m.lookup_blocks)},
            "written_bytes": m.written_bytes, "evictions": m.evictions, "corrupt_blocks": m.corrupt_blocks,
            "dropped_writes": m.dropped_writes, "degraded": dict(m.degraded),
        }

    def counters(self) -> dict[str, int | float]:
        """Cheap totals for a worker's Health stats (no index scan): `kvstore_*` names."""
        m = self.metrics
        return {"kvstore_bytes": max(self._bytes, 0), "kvstore_lookup_blocks_total": sum(m.lookup_blocks.values()),
                "kvstore_hit_blocks_total": sum(m.hit_blocks.values()), "kvstore_loads_total": sum(m.loads.values()),
                "kvstore_written_bytes_total": m.written_bytes, "kvstore_evictions_total": m.evictions,
                "kvstore_expirations_total": sum(m.expirations.values()), "kvstore_corrupt_blocks_total": m.corrupt_blocks,
                "kvstore_dropped_writes_total": m.dropped_writes, "kvstore_degraded_lookups_total": sum(m.degraded.values())}

    def health_stats(self) -> dict:
        """What a worker's Health stats carry (no index scan): `counters()` plus `kvstore_classes`, per traffic
        class this process looked up or the store holds: lookup and hit blocks, hit rate, loads, expirations
        (this process's counts) and the blocks and bytes stored (the whole store, as the sweeper thread last
        read it: instances sharing a store report the same figure)."""
        m, stored = self.metrics, self._stored_by_class
        classes = {}
        for c in sorted(set(m.lookup_blocks) | set(stored) | set(m.expirations)):
            n, nbytes = stored.get(c, (0, 0))
            classes[c] = {"lookup_blocks": m.lookup_blocks.get(c, 0), "hit_blocks": m.hit_blocks.get(c, 0),
                          "hit_rate": m.hit_rate(c), "loads": m.loads.get(c, 0),
                          "expirations": m.expirations.get(c, 0), "stored_blocks": n, "stored_bytes": nbytes}
        return {**self.counters(), "kvstore_backend": self.backend.name, "kvstore_classes": classes}

    def close(self) -> None:
        """Blocks until queued writes are done (bounded) and the threads stopped; closes the backend."""
        self.flush(10.0)
        self._stop.set()
        for t in self._threads:
            t.join(2.0)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
        self.index.close()


def open_store(config: KVStoreConfig | None = None, **kwargs) -> KVStore:
    """A `KVStore` for `config` (the embedded default when None)."""
    return KVStore(config, **kwargs)


def open_worker_store(config: KVStoreConfig | None, log: logging.Logger) -> KVStore | None:
    """A serving instance's store: None when `config` is None (off) or the store cannot be opened (logged: the
    instance serves without it, a store that is down costs hits, never the instance)."""
    if config is None:
        return None
    try:
        return open_store(config)
    except Exception as e:
        log.error("the %s KV store cannot be opened (serving without it): %s", config.backend, e)
        return None
