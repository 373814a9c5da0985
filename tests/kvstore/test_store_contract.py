"""The KV store contract, run against every backend (embedded directories and Mooncake Store).

Prefix lookups and loads, TTL by traffic class with a clock the tests advance (agent expires at 3 days,
chat survives; a hit restarts the TTL), LRU eviction between watermarks, integrity (flipped bytes,
truncation, a wrong predecessor are misses and deleted), survival across a reopen, a down or slow
store answered as misses within the lookup timeout, and the metrics.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from deepinfer.kvstore import KVStore, chain_keys
from deepinfer.kvstore.backends import BlobBackend, StoreUnavailable
from deepinfer.kvstore.keys import KEY_NBYTES

DAY = 86400.0
BS = 4


class Clock:
    def __init__(self, t: float = 1.0e9) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def _chain(n: int, seed: bytes | None = None) -> list[bytes]:
    """n keys of a fresh chain (a random root, so tests sharing one Mooncake master never collide)."""
    return chain_keys(seed or os.urandom(KEY_NBYTES), list(range(n * BS)), BS)


def _payload(i: int, n: int = 3000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def _put_chain(store: KVStore, keys: list[bytes], cls: str | None = None, nbytes: int = 3000) -> None:
    for i, k in enumerate(keys):
        assert store.put(k, keys[i - 1] if i else None, _payload(i, nbytes), cls)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def make_store(store_config, clock):
    stores = []

    def make(**kw) -> KVStore:
        threads = kw.pop("start_threads", False)
        s = KVStore(store_config(**kw), clock=clock, start_threads=threads)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def test_round_trip_and_longest_prefix(make_store):
    store = make_store()
    keys = _chain(5)
    _put_chain(store, keys[:3])
    assert store.stored_prefix(keys) == 3
    got = store.load_prefix(keys, "chat")
    assert [bytes(p) for p in got] == [_payload(i) for i in range(3)]
    assert store.metrics.hit_blocks["chat"] == 3 and store.metrics.lookup_blocks["chat"] == 5
    assert store.metrics.loads["chat"] == 1
    # a hole ends the prefix: block 1 missing -> only block 0
    other = _chain(3)
    store.put(other[0], None, _payload(0), "chat")
    store.put(other[2], other[1], _payload(2), "chat")
    assert store.stored_prefix(other) == 1 and len(store.load_prefix(other)) == 1


def test_async_writes_land(make_store):
    store = make_store(start_threads=True)
    keys = _chain(4)
    n = store.put_async([(k, keys[i - 1] if i else None, _payload(i)) for i, k in enumerate(keys)], "agent")
    assert n == 4 and store.flush(20.0)
    assert store.stored_prefix(keys) == 4
    st = store.stats()
    assert st["classes"]["agent"]["blocks"] >= 4 and st["written_bytes"] > 4 * 3000


def test_ttl_by_class(make_store, clock):
    store = make_store()
    agent, chat = _chain(2), _chain(2)
    _put_chain(store, agent, "agent")
    _put_chain(store, chat, "chat")
    clock.advance(3 * DAY - 60)
    assert store.sweep() == 0 and store.stored_prefix(agent) == 2
    clock.advance(120)  # the agent entries are 3 days + 1 min old: expired; chat ones of the same age live
    assert store.stored_prefix(agent) == 0  # expired entries are never served, even before the sweep
    assert store.sweep() == 2
    assert store.metrics.expirations == {"agent": 2}
    assert store.stored_prefix(chat) == 2 and len(store.load_prefix(chat, "chat")) == 2
    clock.advance(7 * DAY)
    assert store.sweep() == 2 and store.stored_prefix(chat) == 0
    assert store.backend.read(agent[0].hex(), "") is None or store.backend.name == "mooncake"


def test_hit_restarts_ttl(make_store, clock):
    store = make_store()
    keys = _chain(2)
    _put_chain(store, keys, "agent")
    clock.advance(2 * DAY)
    assert len(store.load_prefix(keys, "agent")) == 2  # the hit restarts the 3-day TTL
    clock.advance(2 * DAY)  # 4 days after the write, 2 after the hit
    assert store.sweep() == 0 and store.stored_prefix(keys) == 2
    clock.advance(1 * DAY + 60)
    assert store.sweep() == 2 and store.stored_prefix(keys) == 0


def test_chat_hit_extends_an_agent_entry(make_store, clock):
    store = make_store()
    keys = _chain(1)
    _put_chain(store, keys, "agent")
    assert len(store.load_prefix(keys, "chat")) == 1  # a chat hit: the longer TTL wins
    clock.advance(5 * DAY)
    assert store.sweep() == 0 and store.stored_prefix(keys) == 1


def test_lru_eviction_between_watermarks(make_store, clock):
    # blocks of 3000 B + header; 8 fit under 90 % of 30 kB, a 9th passes it: evict down to 50 %
    store = make_store(capacity_bytes=30_000, high_watermark=0.9, low_watermark=0.5)
    chains = [_chain(1) for _ in range(10)]
    for c in chains[:8]:
        _put_chain(store, c)
        clock.advance(1)
    assert store.metrics.evictions == 0
    assert len(store.load_prefix(chains[0])) == 1  # chain 0 used last now: evicted last
    clock.advance(1)
    _put_chain(store, chains[8])  # 9 blocks > 90 %: evict LRU down to 50 % (4 blocks kept)
    assert store.metrics.evictions == 5
    held = [store.stored_prefix(c) for c in chains[:9]]
    assert held == [1, 0, 0, 0, 0, 0, 1, 1, 1], held  # the least recently used went first; the hit one stayed
    assert store.index.total_bytes() <= 0.5 * 30_000


@pytest.mark.parametrize("damage", ["flip", "truncate", "parent"])
def test_corrupt_block_is_a_miss_and_deleted(make_store, damage):
    store = make_store()
    keys = _chain(3)
    _put_chain(store, keys)
    k = keys[1]
    entry = store.index.get(k.hex())
    if damage == "flip":
        store.backend.tamper(k.hex(), entry.ref, lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:])
    elif damage == "truncate":
        store.backend.tamper(k.hex(), entry.ref, lambda b: b[:1000])
    else:  # a block re-filed after another predecessor (a broken chain)
        from deepinfer.kvstore import block_format

        store.backend.tamper(k.hex(), entry.ref, lambda b: block_format.encode(k, os.urandom(KEY_NBYTES), _payload(1)))
    got = store.load_prefix(keys)
    assert len(got) == 1  # block 1 refused: the prefix ends before it
    assert store.metrics.corrupt_blocks == 1
    assert store.index.get(k.hex()) is None and store.stored_prefix(keys) == 1


def test_survives_reopen(make_store, store_config, clock):
    store = make_store()
    keys = _chain(3)
    _put_chain(store, keys, "chat")
    store.close()
    again = KVStore(store_config(), clock=clock, start_threads=False)  # a new process would see the same
    try:
        assert [bytes(p) for p in again.load_prefix(keys, "chat")] == [_payload(i) for i in range(3)]
    finally:
        again.close()


class _Broken(BlobBackend):
    """Wraps a backend: every read fails or hangs."""

    def __init__(self, inner: BlobBackend, mode: str) -> None:
        self.inner, self.mode = inner, mode
        self.name, self.is_shared = inner.name, inner.is_shared

    def write(self, key, ref, blob, ttl_s=None):
        if self.mode == "down":
            raise StoreUnavailable("connection refused")
        self.inner.write(key, ref, blob, ttl_s)

    def read(self, key, ref):
        if self.mode == "down":
            raise StoreUnavailable("connection refused")
        time.sleep(2.0)
        return self.inner.read(key, ref)

    def delete(self, key, ref):
        self.inner.delete(key, ref)

    def exists(self, keys):
        return self.inner.exists(keys)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("mode", ["down", "slow"])
def test_store_down_or_slow_is_a_bounded_miss(make_store, store_config, clock, mode):
    good = make_store()
    keys = _chain(2)
    _put_chain(good, keys)
    store = KVStore(store_config(lookup_timeout_s=0.2), backend=_Broken(good.backend, mode), clock=clock,
                    start_threads=False, backoff_s=30.0)
    try:
        t = time.monotonic()
        assert store.load_prefix_bounded(keys, "chat") == []
        assert time.monotonic() - t < 1.0
        assert store.metrics.degraded == {"unavailable" if mode == "down" else "timeout": 1}
        t = time.monotonic()
        assert store.load_prefix_bounded(keys, "chat") == []  # backing off: the store is not asked at all
        assert time.monotonic() - t < 0.05 and store.metrics.degraded.get("backing_off") == 1
        if mode == "down":
            assert not store.put(os.urandom(KEY_NBYTES), None, b"x", "chat")
            assert store.metrics.dropped_writes == 1
    finally:
        store.index.close()
        store._readers.shutdown(wait=False)


def test_clear_evict_and_metrics(make_store):
    store = make_store()
    _put_chain(store, _chain(4), "agent")
    _put_chain(store, _chain(2), "chat")
    store.load_prefix(_chain(2), "chat")  # a miss
    st = store.stats()
    assert st["blocks"] == 6 and st["classes"]["agent"]["ttl_s"] == 3 * DAY
    assert st["hit_rate"]["chat"] == 0.0
    text = store.metrics.render().decode()
    for name in ("deepinfer_kvstore_hit_rate", "deepinfer_kvstore_stored_bytes", "deepinfer_kvstore_loads_total",
                 "deepinfer_kvstore_evictions_total", "deepinfer_kvstore_expirations_total"):
        assert name in text
    assert store.evict(1) == 1 and store.stats()["blocks"] == 5
    assert store.clear() == 5 and store.stats()["blocks"] == 0


def test_store_cli(tmp_path, capsys):
    from deepinfer.kvstore import KVStoreConfig
    from deepinfer.kvstore.cli import main

    store = KVStore(KVStoreConfig(directories=(str(tmp_path),)), start_threads=False)
    _put_chain(store, _chain(3), "agent")
    store.close()
    assert main(["store", "stats", "--dirs", str(tmp_path)]) == 0
    assert "3 blocks" in capsys.readouterr().out
    assert main(["store", "evict", "--dirs", str(tmp_path), "--bytes", "0.000001"]) == 0
    assert "evicted 1" in capsys.readouterr().out
    assert main(["store", "clear", "--dirs", str(tmp_path)]) == 0
    assert "cleared 2" in capsys.readouterr().out


def test_embedded_spreads_over_directories_and_removes_orphans(make_store, store_config):
    if store_config.backend != "embedded":
        pytest.skip("block files and directories are the embedded backend's")
    store = make_store()
    _put_chain(store, _chain(6))
    dirs = store.backend.dirs
    counts = [sum(1 for _ in Path(d).rglob("*.blk")) for d in dirs]
    assert counts == [3, 3], counts  # the least filled directory takes each new block
    orphan = os.path.join(dirs[1], "ff", "ff" * 16 + ".blk")
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    with open(orphan, "wb") as f:
        f.write(b"left by a crash before indexing")
    assert store.remove_orphans(min_age_s=0) == 1 and not os.path.exists(orphan)
    assert store.stored_prefix(_chain(1)) == 0 and store.stats()["blocks"] == 6
