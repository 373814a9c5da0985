"""Block accounting of the paged compressed-KV cache: ids, ref counts, prefix hashes, state slots.

This module never touches a tensor. `engine.cache.kv_cache.V4KVCache` owns the pool tensors and
indexes them by the block ids and slot ids handed out here.

* `BlockPool` — `num_blocks` blocks of `block_size` tokens each. A block has a ref count and, once
  it is full and registered, a prefix hash. Blocks with ref count 0 sit in a free queue; those that
  still carry a hash stay reusable (a prefix-cache hit takes them back) until a new allocation pops
  them from the front of the queue, which evicts their hash. The queue is LRU: the least recently
  freed block is evicted first.
* `hash_block_tokens` — a chained SHA-256 of a block's tokens, its parent block's hash and extra keys
  (image content hashes for blocks that hold image placeholders), so equal prefixes give equal chains.
* `KVCacheManager` — per-request block tables on top of the pool: prefix lookup, slot allocation,
  freeing, hash registration, copy-free sharing (`fork`) and reservations for KV written from outside
  (`import_blocks`).
* `StateSlotPool` — fixed-size per-request slots for the bounded state (sliding-window ring and
  compressor buffers); every running request holds exactly one.
* `CacheConfig` — the frozen, validated knobs of all of the above.

NOTE (DeepSeek-V4): a block of `block_size` tokens holds `block_size // rate` compressed entries per
compressed layer, so `block_size` must be a multiple of every compress rate; a full block then holds
only finished compressor windows and its entries depend on nothing but the block's prefix, which is
what makes prefix hashing sound. `CacheConfig.check_compress_rates` enforces it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

BlockHash = int
"""A block's prefix hash: the first 8 bytes of a SHA-256, as an unsigned little-endian int."""

_HASH_MASK = (1 << 64) - 1


# ---------------------------------------------------------------------------------------- config


class CacheConfig(BaseModel):
    """How the compressed-KV cache of one instance is sized and shared."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(128, gt=0)
    """Tokens per block; must be a multiple of every compress rate of the model (4 and 128 for V4-Flash)."""
    num_blocks: int | None = Field(None, gt=0)
    """Blocks in the pool; None sizes the pool from `memory_fraction` of the device memory."""
    memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of device memory the whole instance may use when `num_blocks` is None."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests with equal prefixes and keep freed ones until evicted."""
    num_state_slots: int = Field(256, gt=0)
    """Bounded-state slots (one per running request); caps the number of running requests."""

    def check_compress_rates(self, compress_rates: Mapping[str, int] | Iterable[int]) -> None:
        """Raise ValueError unless `block_size` is a multiple of every compress rate.

        Accepts `ModelConfig.compress_rates` (a layer type -> rate mapping) or plain rates.
        """
        items = list(compress_rates.items()) if isinstance(compress_rates, Mapping) else [
            (f"rate {r}", r) for r in compress_rates
        ]
        rates = [r for _, r in items]
        for name, rate in items:
            if rate <= 0:
                raise ValueError(f"compress rate of {name} must be positive; got {rate}.")
        if not rates:
            return
        lcm = math.lcm(*rates)
        bad = [f"{name}={rate}" for name, rate in items if self.block_size % rate]
        if bad:
            raise ValueError(
                f"cache block_size={self.block_size} is not a multiple of the compress rate(s) {', '.join(bad)}; "
                f"set block_size to a multiple of {lcm} (the least common multiple of all rates), e.g. "
                f"{lcm * max(1, round(self.block_size / lcm))}."
            )

    def num_entries_per_block(self, compress_rate: int) -> int:
        """Compressed entries one block holds for a layer of `compress_rate` tokens per entry."""
        self.check_compress_rates([compress_rate])
        return self.block_size // compress_rate


# ---------------------------------------------------------------------------------------- hashing


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = ()
) -> BlockHash:
    """Chained prefix hash of one block.

    `parent_hash` is the previous block's hash (None for the first block), `token_ids` the block's
    tokens, `extra_keys` anything else the block's KV depends on (e.g. content hashes of the images
    whose placeholders it holds). Supported key types: None, bool, int, float, str, bytes and
    tuples/lists of those. The serialisation is stable across processes and Python versions.
    """
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(b"R")
    else:
        h.update(b"P" + (parent_hash & _HASH_MASK).to_bytes(8, "little"))
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_key(tuple(extra_keys)))
    return int.from_bytes(h.digest()[:8], "little")


def _encode_key(key: Any) -> bytes:
    """Tagged, length-prefixed encoding of an extra key (unambiguous: distinct keys, distinct bytes)."""
    if key is None:
        return b"N"
    if isinstance(key, bool):
        return b"B1" if key else b"B0"
    if isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"I" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, float):
        return b"F" + struct.pack("<d", key)
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"S" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, (bytes, bytearray)):
        return b"Y" + struct.pack("<I", len(key)) + bytes(key)
    if isinstance(key, (tuple, list)):
        return b"T" + struct.pack("<I", len(key)) + b"".join(_encode_key(k) for k in key)
    raise TypeError(f"extra key of type {type(key).__name__} cannot be hashed stably; use str, bytes, int or tuples.")


# ---------------------------------------------------------------------------------------- block pool


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (nothing was allocated)."""


class BlockPool:
    """Ids, ref counts and prefix hashes of `num_blocks` cache blocks of `block_size` tokens each.

    NOTE: the free queue holds every block with ref count 0, cached or not. Freed blocks that carry a
    hash go to the back (LRU eviction: the least recently freed cached block goes first); freed
    blocks without a hash go to the front, since reusing them first loses no cached prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive; got {num_blocks}.")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive; got {block_size}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block_id: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): what an allocation may take."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a prefix hash (in use or evictable)."""
        return len(self._hash_to_block_id)

    def ref_count(self, block_id: int) -> int:
        """How many requests reference `block_id`."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The prefix hash registered for `block_id`, if any."""
        return self._block_hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first = next to be allocated)."""
        return list(self._free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block id holding the prefix `block_hash`, or None."""
        return self._hash_to_block_id.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the front of the free queue (evicting their hashes), ref count 1.

        Raises NoFreeBlocksError (allocating nothing) when fewer are free.
        """
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(f"need {num_blocks} free blocks, have {len(self._free_queue)}")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix hit); a free cached block leaves the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_hashes[block_id] is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register `block_hash` for the full block `block_id`; False if another block already holds it.

        NOTE: two requests may compute the same prefix at the same time; the first registration wins
        and the duplicate block stays uncached (it is reused first once freed).
        """
        if not self.enable_prefix_caching:
            return False
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated; only blocks in use can be registered")
        current = self._block_hashes[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self._hash_to_block_id:
            return False
        self._block_hashes[block_id] = block_hash
        self._hash_to_block_id[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix hash; only allowed (returns True) when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._hash_to_block_id.clear()
        self._block_hashes = [None] * self.num_blocks
        return True

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            self._block_hashes[block_id] = None
            if self._hash_to_block_id.get(block_hash) == block_id:
                del self._hash_to_block_id[block_hash]


# ---------------------------------------------------------------------------------------- manager


@runtime_checkable
class CacheRequest(Protocol):
    """What `KVCacheManager` needs from a request.

    A request may also define `extra_keys_for_block(start: int, end: int) -> tuple`, the extra hash
    keys of the block covering token positions `[start, end)` (e.g. content hashes of the images whose
    placeholders overlap it); without it, blocks hash their tokens only.
    """

    @property
    def req_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by the output tokens so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is (or is scheduled to be) in the cache."""
        ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, with prefix caching and copy-free sharing.

    A request's table is a list of block ids; block `i` holds tokens `[i * block_size, (i+1) * block_size)`.
    Two requests whose prefixes are equal and cached reference the same block ids (ref count 2).
    Every method takes the request object (see `CacheRequest`) and keys its state by `req_id`.
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        self.enable_prefix_caching = block_pool.enable_prefix_caching
        self._req_to_block_ids: dict[str, list[int]] = {}
        self._req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.num_prefix_query_tokens = 0
        """Prompt tokens looked up in the prefix cache (every lookup counts)."""
        self.num_prefix_hit_tokens = 0
        """Tokens those lookups found cached."""

    @classmethod
    def from_config(cls, cache_config: CacheConfig) -> KVCacheManager:
        """Build the pool from a config whose `num_blocks` is known."""
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks is None; profile the device memory first or set num_blocks.")
        return cls(BlockPool(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching))

    # ------------------------------------------------------------------ introspection

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (free, including evictable cached ones)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.block_pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over query tokens (0 before any query)."""
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def get_block_ids(self, req: CacheRequest, start: int = 0) -> list[int]:
        """A copy of the request's block table from index `start` on."""
        return self._req_to_block_ids.get(req.req_id, [])[start:]

    def num_blocks_held(self, req: CacheRequest) -> int:
        """Length of the request's block table."""
        return len(self._req_to_block_ids.get(req.req_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return _cdiv(num_tokens, self.block_size)

    def shares_pool(self, a: CacheRequest, b: CacheRequest) -> bool:
        """Whether freeing `a`'s blocks makes room for `b` (one pool: always; per-rank pools override it)."""
        return True

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[int], int]:
        """Longest chain of cached full blocks of the request's tokens: `(block_ids, num_computed_tokens)`.

        At least one token is always left to compute (the engine needs logits of the last one), so a
        block-aligned, fully cached sequence yields one block fewer. Takes no reference: pass the ids
        to `allocate_slots` before anything else allocates.
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = len(req.all_token_ids)
        self.num_prefix_query_tokens += num_tokens
        max_blocks = (num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._block_hashes(req, max_blocks):
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_hit_tokens = len(block_ids) * self.block_size
        self.num_prefix_hit_tokens += num_hit_tokens
        return block_ids, num_hit_tokens

    def cache_full_blocks(self, req: CacheRequest, num_tokens: int) -> None:
        """Register prefix hashes of the request's blocks that are full within its first `num_tokens` tokens.

        Call once the KV of those tokens is written (or its write is ordered before any reader).
        """
        if not self.enable_prefix_caching:
            return
        block_ids = self._req_to_block_ids.get(req.req_id)
        if not block_ids:
            return
        num_full = min(num_tokens, len(req.all_token_ids)) // self.block_size
        num_full = min(num_full, len(block_ids))
        num_done = self._num_cached_blocks.get(req.req_id, 0)
        if num_full <= num_done:
            return
        hashes = self._block_hashes(req, num_full)
        for i in range(num_done, num_full):
            self.block_pool.cache_block(block_ids[i], hashes[i])
        self._num_cached_blocks[req.req_id] = num_full

    def _block_hashes(self, req: CacheRequest, num_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first `num_blocks` full blocks (memoised per request)."""
        hashes = self._req_to_block_hashes.setdefault(req.req_id, [])
        if len(hashes) < num_blocks:
            token_ids = req.all_token_ids
            extra_fn = getattr(req, "extra_keys_for_block", None)
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                start, end = i * bs, (i + 1) * bs
                extra = tuple(extra_fn(start, end)) if extra_fn is not None else ()
                hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:end], extra))
        return hashes[:num_blocks]

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        req: CacheRequest,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make the request's table cover `num_computed_tokens + num_new_tokens + num_lookahead_tokens` tokens.

        `num_computed_tokens` defaults to `req.num_computed_tokens`. `computed_block_ids` (from
        `get_computed_blocks`) are prepended for a request that holds no blocks yet; they are shared,
        not copied. Returns False, taking nothing, when the pool lacks free blocks.
        """
        block_ids = self._req_to_block_ids.get(req.req_id)
        if computed_block_ids and block_ids:
            raise ValueError(f"request {req.req_id} already holds blocks; computed blocks only start a table")
        start = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_required = self.num_blocks_for(start + num_new_tokens + num_lookahead_tokens)
        num_held = len(block_ids or ()) + len(computed_block_ids)
        num_new_blocks = max(0, num_required - num_held)
        # NOTE: a cached block with ref count 0 sits in the free queue; taking it costs free capacity.
        num_evictable = sum(1 for b in computed_block_ids if self.block_pool.ref_count(b) == 0)
        if num_new_blocks + num_evictable > self.block_pool.num_free_blocks:
            return False
        if block_ids is None:
            block_ids = self._req_to_block_ids[req.req_id] = []
        if computed_block_ids:
            self.block_pool.touch(computed_block_ids)
            block_ids.extend(computed_block_ids)
            self._num_cached_blocks[req.req_id] = len(computed_block_ids)
        if num_new_blocks:
            block_ids.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def import_blocks(
        self, req: CacheRequest, num_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> list[int]:
        """Reserve a table for `num_tokens` tokens whose KV will be written from outside (a KV transfer).

        `computed_block_ids` (a local prefix hit) lead the table; only the blocks after them need the
        transfer. Returns the whole table. Raises NoFreeBlocksError (reserving nothing) when the pool
        is short. Call `cache_full_blocks(req, num_tokens)` once the transfer has landed.
        """
        if self._req_to_block_ids.get(req.req_id):
            raise ValueError(f"request {req.req_id} already holds blocks; import into an empty table")
        if not self.allocate_slots(req, num_tokens, computed_block_ids, num_computed_tokens=0):
            raise NoFreeBlocksError(
                f"request {req.req_id} needs {self.num_blocks_for(num_tokens)} blocks for {num_tokens} tokens; "
                f"{self.num_free_blocks} are free"
            )
        return self.get_block_ids(req)

    def fork(self, parent_req: CacheRequest, child_req: CacheRequest, num_tokens: int | None = None) -> list[tuple[int, int]]:
        """Give `child_req` the parent's first `num_tokens` tokens of KV (default: its computed tokens).

        Full blocks are shared (ref count +1); a partial last block is given a fresh block for the
        child. Returns the `(src_block_id, dst_block_id)` pairs the tensor side must copy. Raises
        NoFreeBlocksError (changing nothing) when no block is free for the copy.
        """
        if self._req_to_block_ids.get(child_req.req_id):
            raise ValueError(f"request {child_req.req_id} already holds blocks; fork into an empty table")
        num_tokens = parent_req.num_computed_tokens if num_tokens is None else num_tokens
        parent_ids = self._req_to_block_ids.get(parent_req.req_id, [])
        if self.num_blocks_for(num_tokens) > len(parent_ids):
            raise ValueError(
                f"request {parent_req.req_id} holds {len(parent_ids)} blocks, fewer than its {num_tokens} tokens need"
            )
        num_full, num_partial = divmod(num_tokens, self.block_size)
        copy_pairs: list[tuple[int, int]] = []
        new_ids: list[int] = []
        if num_partial:
            new_ids = self.block_pool.allocate(1)
            copy_pairs.append((parent_ids[num_full], new_ids[0]))
        shared = parent_ids[:num_full]
        self.block_pool.touch(shared)
        self._req_to_block_ids[child_req.req_id] = shared + new_ids
        self._num_cached_blocks[child_req.req_id] = min(self._num_cached_blocks.get(parent_req.req_id, 0), num_full)
        return copy_pairs

    def free(self, req: CacheRequest) -> None:
        """Drop the request's references, tail first (so its last blocks are evicted first), and its state."""
        block_ids = self._req_to_block_ids.pop(req.req_id, None)
        self._req_to_block_hashes.pop(req.req_id, None)
        self._num_cached_blocks.pop(req.req_id, None)
        if block_ids:
            self.block_pool.free(reversed(block_ids))


# ---------------------------------------------------------------------------------------- state slots


class NoFreeSlotsError(RuntimeError):
    """Every bounded-state slot is held by a running request."""


class StateSlotPool:
    """Ids of `num_slots` fixed-size bounded-state slots; a running request holds exactly one."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive; got {num_slots}.")
        self.num_slots = num_slots
        self._free_slot_ids: deque[int] = deque(range(num_slots))
        self._req_to_slot_id: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._free_slot_ids)

    def allocate(self, req_id: str) -> int:
        """Give `req_id` a slot and return its id; raises if it already holds one or none is free."""
        if req_id in self._req_to_slot_id:
            raise ValueError(f"request {req_id} already holds slot {self._req_to_slot_id[req_id]}")
        if not self._free_slot_ids:
            raise NoFreeSlotsError(f"all {self.num_slots} state slots are in use")
        slot_id = self._free_slot_ids.popleft()
        self._req_to_slot_id[req_id] = slot_id
        return slot_id

    def transfer(self, req_id: str, new_owner: str) -> int:
        """Hand `req_id`'s slot to `new_owner` (e.g. a hold outliving the request); returns its id."""
        if new_owner in self._req_to_slot_id:
            raise ValueError(f"{new_owner} already holds slot {self._req_to_slot_id[new_owner]}")
        slot_id = self._req_to_slot_id.pop(req_id)
        self._req_to_slot_id[new_owner] = slot_id
        return slot_id

    def get_slot_id(self, req_id: str) -> int | None:
        """The slot `req_id` holds, if any."""
        return self._req_to_slot_id.get(req_id)

    def free(self, req_id: str) -> bool:
        """Return `req_id`'s slot to the pool; False if it held none."""
        slot_id = self._req_to_slot_id.pop(req_id, None)
        if slot_id is None:
            return False
        self._free_slot_ids.append(slot_id)
        return True
