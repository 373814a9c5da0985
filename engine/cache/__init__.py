"""The compressed-KV cache: block accounting (`block_pool`) and the pool tensors (`kv_cache`)."""

from engine.cache.block_pool import (
    BlockPool,
    CacheConfig,
    KVCacheManager,
    NoFreeBlocksError,
    NoFreeSlotsError,
    StateSlotPool,
    hash_block_tokens,
)

__all__ = [
    "BlockPool",
    "CacheConfig",
    "KVCacheManager",
    "NoFreeBlocksError",
    "NoFreeSlotsError",
    "StateSlotPool",
    "hash_block_tokens",
]
