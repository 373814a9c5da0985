"""Store keys: a 128-bit prefix-chain hash of a prompt's full blocks, rooted in a model + config fingerprint.

Block `i`'s key hashes the key of block `i - 1` (the fingerprint for block 0) and block `i`'s tokens, so a
key names the whole token prefix `[0, (i + 1) * block_size)` under one model, cache layout and numerics.
NOTE: these are not the engine's 64-bit prefix hashes (`engine.cache.block_pool.hash_block_tokens`): a
store shared by a cluster for days holds far more blocks than one instance's pool, and a 64-bit collision
there would serve another prompt's KV; 128 bits make that negligible.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KEY_NBYTES = 16
"""Bytes of a block key (and of a fingerprint)."""

_HEAD_BYTES = 1 << 20
_TAIL_BYTES = 1 << 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_NBYTES)
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.digest()


def weights_identity(model_path: str) -> str:
    """A cheap identity of a checkpoint's weights: each safetensors file's name, size and a hash of its first
    MiB and last 64 KiB (headers and leading tensors). Two checkpoints of the same config but different
    weights (another seed, a fine-tune) differ here without reading the whole checkpoint."""
    parts = []
    try:
        names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    except OSError:
        return os.path.abspath(model_path)
    for name in names:
        path = os.path.join(model_path, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEAD_BYTES)
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read()
        parts.append(f"{name}:{size}:{hashlib.sha256(head + tail).hexdigest()}")
    return ";".join(parts) or os.path.abspath(model_path)


def store_fingerprint(model_config: Mapping[str, Any] | Any, *, block_size: int, cache_dtype: str,
                      pool_shapes: Mapping[str, Sequence[int]], weights_id: str = "",
                      numerics: Mapping[str, Any] | None = None) -> bytes:
    """The 16-byte root of every key chain: the model's config (a mapping or a pydantic model), the cache's
    block size, dtype and per-block pool shapes, the weights' identity and the numerics options that change
    the KV's bits (backends, activation and indexer numerics). Any difference gives disjoint keys."""
    cfg = model_config.model_dump(mode="json") if hasattr(model_config, "model_dump") else dict(model_config)
    doc = {"config": cfg, "block_size": block_size, "cache_dtype": str(cache_dtype),
           "pools": {k: list(v) for k, v in pool_shapes.items()}, "weights": weights_id,
           "numerics": dict(numerics or {}), "format": 1}
    return _digest(b"deepinfer-kvstore", json.dumps(doc, sort_keys=True, default=str).encode())


def chain_keys(fingerprint: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `token_ids` (default: every full block)."""
    if len(fingerprint) != KEY_NBYTES:
        raise ValueError(f"fingerprint must be {KEY_NBYTES} bytes, got {len(fingerprint)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    n = n_full if num_blocks is None else min(num_blocks, n_full)
    keys, prev = [], fingerprint
    for i in range(n):
        block = token_ids[i * block_size:(i + 1) * block_size]
        prev = _digest(prev, struct.pack(f"<{block_size}q", *block))
        keys.append(prev)
    return keys


def key_hex(key: bytes) -> str:
    """The printable form backends name a block by (32 hex digits)."""
    return key.hex()


def keys_hex(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]
