"""The compressed-KV cache: block accounting (`block_pool`), the layout (`layout`: layer kinds, block
size, replay length and every pool's byte layout, the one owner) and the pool tensors (`kv_cache`)."""

from deepinfer.engine.cache.block_pool import (
    BlockPool,
    CacheConfig,
    KVCacheManager,
    NoFreeBlocksError,
    NoFreeSlotsError,
    StateSlotPool,
    hash_block_tokens,
)
from deepinfer.engine.cache.layout import CacheLayout, PoolLayout, default_block_size, exact_replay_tokens

__all__ = [
    "BlockPool",
    "CacheConfig",
    "CacheLayout",
    "KVCacheManager",
    "NoFreeBlocksError",
    "NoFreeSlotsError",
    "PoolLayout",
    "StateSlotPool",
    "default_block_size",
    "exact_replay_tokens",
    "hash_block_tokens",
]
