"""The persistent compressed-KV store: prompts' compressed entries kept for days, across workers and restarts.

DESIGN.md §4 and §6: a block of compressed KV (CSA main + CSA indexer keys + HCA main entries of every
layer for `block_size` tokens) is small, so it is worth keeping long after the request that computed it;
the bounded state is never stored (a hit rebuilds it by bounded replay). The pieces:

* `keys` — the store key of a block: a 128-bit prefix-chain hash rooted in a model + config
  fingerprint, so a key names one token prefix under one model, cache layout and numerics;
* `block_format` — one stored block: a header (magic, key, predecessor key, payload length, CRC32)
  and the payload; a corrupt, truncated or mismatched block is refused, never served;
* `index` — the SQLite index every backend shares: traffic class, TTL (restarted on each hit),
  last use, size; the sweeper and the LRU eviction between watermarks read it;
* `backends` — where the bytes live, behind one small interface (`BlobBackend`): `embedded`
  (block files in one or more local directories, aligned direct I/O) and `mooncake` (Mooncake Store
  over its master, TCP on loopback here, RDMA on clusters);
* `store` — `KVStore`: the one object the connector talks to (put / lookup / get, TTL by class,
  integrity, metrics, bounded lookups), the same over every backend;
* `metrics` — its Prometheus metrics (prefix `deepinfer_kvstore_`).

The engine side is `engine/kv_connector/store_connector.py` (`StoreConnector`, a `KVConnector`).
"""

from deepinfer.kvstore.config import DEFAULT_CLASS_TTLS_S, KVStoreConfig
from deepinfer.kvstore.keys import chain_keys, store_fingerprint
from deepinfer.kvstore.store import KVStore, open_store

__all__ = ["DEFAULT_CLASS_TTLS_S", "KVStore", "KVStoreConfig", "chain_keys", "open_store", "store_fingerprint"]
