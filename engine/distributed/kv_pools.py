"""Per-rank KV pools behind the one scheduler of a multi-rank instance (attention data parallelism).

Each rank owns its requests and their KV, so each rank's cache holds only its own blocks: `num_blocks`
per rank, not the instance's total. Rank 0's scheduler still sees one block-id space, cut in ranks:
global block id `g` is block `g % B` of rank `g // B` (`B` = blocks per rank). The rank part of the id
is what keeps prefix caching sound: a hash maps to a block of one rank, and a hit is only taken by a
request that runs on that rank.

  * `RankedBlockPool`: one `BlockPool` per rank behind the `BlockPool` interface of global ids; an
    allocation takes blocks of the rank set by `on_rank`.
  * `RankedKVCacheManager`: the `KVCacheManager` whose requests each live on one rank. A new request's
    rank is picked at its prefix lookup (`get_computed_blocks`): the rank holding the longest cached
    prefix among the ranks with a free state slot and room for the request's blocks; else the rank with
    the most free blocks. Forked children stay on their parent's rank.
  * `RankedStateSlotPool`: hands a request a slot of its rank (`rank_of_slot(slot) == rank`), since the
    executor runs a request on the rank owning its slot (`engine.distributed.plan`).
  * `to_local_block_table`: the rank-local ids a rank's attention reads (`plan.split_step`).

  * `locate_blocks`: a request's global block ids and state slot as (rank, the rank's ids, the rank's slot):
    what a KV connector names in a transfer (`kv_transfer.ranked`: the agent of that rank sends or receives).
  * `RankLoad` / `rank_loads`: each rank's KV blocks, running and waiting requests (the workers' load report,
    what a balancer picks an (instance, rank) by); `RankedKVCacheManager.prefer_rank` places a request on the
    rank a balancer picked when that rank has room.

The scheduler sees a manager whose `num_blocks` is a rank's pool (the most one request can use), whose
`num_free_blocks` is the emptiest rank's (what a new request can get), and whose `shares_pool` keeps
preemption on the rank that is short. NOTE: the instance's load in those two numbers is therefore one rank's
view; `rank_loads` is the per-rank one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from deepinfer.engine.cache.block_pool import (
    BlockHash,
    BlockPool,
    CacheRequest,
    KVCacheManager,
    NoFreeSlotsError,
    StateSlotPool,
)


def to_local_block_table(block_ids: Sequence[int], blocks_per_rank: int, rank: int) -> list[int]:
    """A request's global block ids as ids of its rank's pool; raises ValueError when a block is another rank's."""
    lo = rank * blocks_per_rank
    local = [b - lo for b in block_ids]
    if any(not 0 <= b < blocks_per_rank for b in local):
        raise ValueError(f"a block table of rank {rank} names blocks of another rank: {list(block_ids)}")
    return local


def locate_blocks(block_ids: Sequence[int], blocks_per_rank: int, world_size: int,
                  slot: int | None = None) -> tuple[int, list[int], int | None]:
    """`(rank, local block ids, local slot)` of one request's global block ids and state slot (slots interleave over
    the ranks: `engine.distributed.plan.rank_of_slot`). Raises ValueError when they span ranks."""
    if not block_ids:
        raise ValueError("a request's KV names at least one block")
    rank = block_ids[0] // blocks_per_rank
    local = to_local_block_table(block_ids, blocks_per_rank, rank)
    local_slot = None
    if slot is not None:
        if slot % world_size != rank:
            raise ValueError(f"state slot {slot} is rank {slot % world_size}'s, the blocks are rank {rank}'s")
        local_slot = slot // world_size
    return rank, local, local_slot


@dataclass
class RankLoad:
    """One rank's load (what a decode balancer picks an (instance, rank) by)."""

    rank: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_running_requests: int
    num_waiting_requests: int
    """Requests placed on the rank that do not run yet (waiting in the scheduler, or their KV is loading)."""


def rank_loads(manager: RankedKVCacheManager, running_req_ids: Iterable[str]) -> list[RankLoad]:
    """Each rank's load: its pool's blocks and the requests on it (`running_req_ids`: the scheduler's running
    requests; every other request placed on a rank counts as waiting there)."""
    pool = manager.block_pool
    running = [0] * manager.world_size
    running_ids = set(running_req_ids)
    waiting = [0] * manager.world_size
    for req_id, rank in manager._rank_of.items():
        if req_id in running_ids:
            running[rank] += 1
        else:
            waiting[rank] += 1
    return [RankLoad(r, pool.blocks_per_rank, pool.blocks_per_rank - pool.num_free_blocks_of(r), running[r], waiting[r])
            for r in range(manager.world_size)]


class RankedBlockPool:
    """`BlockPool` over global ids `rank * blocks_per_rank + local`, one pool per rank (see module docstring).

    NOTE: `allocate` takes from the rank set by `on_rank` (and `num_free_blocks` counts that rank's pool
    while it is set, so `KVCacheManager.allocate_slots` checks the right capacity); every other method
    routes by the id.
    """

    def __init__(self, world_size: int, blocks_per_rank: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.world_size = world_size
        self.blocks_per_rank = blocks_per_rank
        self.pools = [BlockPool(blocks_per_rank, block_size, enable_prefix_caching) for _ in range(world_size)]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._rank: int | None = None

    @contextmanager
    def on_rank(self, rank: int) -> Iterator[None]:
        """Allocations inside take blocks of `rank`'s pool."""
        prev, self._rank = self._rank, rank
        try:
            yield
        finally:
            self._rank = prev

    def _split(self, block_id: int) -> tuple[BlockPool, int]:
        return self.pools[block_id // self.blocks_per_rank], block_id % self.blocks_per_rank

    @property
    def num_blocks(self) -> int:
        """Blocks of all ranks (global ids are `range(num_blocks)`)."""
        return self.blocks_per_rank * self.world_size

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the `on_rank` rank, or of all ranks outside `on_rank`."""
        if self._rank is not None:
            return self.pools[self._rank].num_free_blocks
        return sum(p.num_free_blocks for p in self.pools)

    def num_free_blocks_of(self, rank: int) -> int:
        return self.pools[rank].num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - sum(p.num_free_blocks for p in self.pools) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached_blocks for p in self.pools)

    def ref_count(self, block_id: int) -> int:
        pool, b = self._split(block_id)
        return pool.ref_count(b)

    def block_hash(self, block_id: int) -> BlockHash | None:
        pool, b = self._split(block_id)
        return pool.block_hash(b)

    def free_block_ids(self) -> list[int]:
        return [r * self.blocks_per_rank + b for r, p in enumerate(self.pools) for b in p.free_block_ids()]

    def get_cached_block(self, block_hash: BlockHash, rank: int | None = None) -> int | None:
        """The global id of a block holding `block_hash` on `rank` (default: the `on_rank` rank, else any rank)."""
        rank = self._rank if rank is None else rank
        ranks = range(self.world_size) if rank is None else (rank,)
        for r in ranks:
            b = self.pools[r].get_cached_block(block_hash)
            if b is not None:
                return r * self.blocks_per_rank + b
        return None

    def allocate(self, num_blocks: int) -> list[int]:
        if self._rank is None:
            raise RuntimeError("RankedBlockPool.allocate needs a rank (inside `on_rank`)")
        lo = self._rank * self.blocks_per_rank
        return [lo + b for b in self.pools[self._rank].allocate(num_blocks)]

    def _by_pool(self, block_ids: Iterable[int]) -> Iterator[tuple[BlockPool, list[int]]]:
        # NOTE: one id at a time keeps the caller's order (free order decides eviction order)
        for g in block_ids:
            pool, b = self._split(g)
            yield pool, [b]

    def touch(self, block_ids: Iterable[int]) -> None:
        for pool, ids in self._by_pool(block_ids):
            pool.touch(ids)

    def free(self, block_ids: Iterable[int]) -> None:
        for pool, ids in self._by_pool(block_ids):
            pool.free(ids)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        pool, b = self._split(block_id)
        return pool.cache_block(b, block_hash)

    def reset_prefix_cache(self) -> bool:
        if sum(p.num_free_blocks for p in self.pools) != self.num_blocks:
            return False
        return all(p.reset_prefix_cache() for p in self.pools)


class RankedStateSlotPool(StateSlotPool):
    """State slots handed out on the rank the KV manager picked for the request (`rank_of_slot(slot) == rank`)."""

    def __init__(self, num_slots: int, world_size: int) -> None:
        super().__init__(num_slots)
        self.world_size = world_size
        self.rank_of_request = lambda req_id: None
        """Set by `RankedKVCacheManager`: the rank a request's blocks live on (None: any)."""

    def num_free_slots_of(self, rank: int) -> int:
        return sum(1 for s in self._free_slot_ids if s % self.world_size == rank)

    def allocate(self, req_id: str) -> int:
        rank = self.rank_of_request(req_id)
        if rank is None:
            return super().allocate(req_id)
        if req_id in self._req_to_slot_id:
            raise ValueError(f"request {req_id} already holds slot {self._req_to_slot_id[req_id]}")
        for slot_id in self._free_slot_ids:
            if slot_id % self.world_size == rank:
                self._free_slot_ids.remove(slot_id)
                self._req_to_slot_id[req_id] = slot_id
                return slot_id
        raise NoFreeSlotsError(f"no free state slot on rank {rank}")


class RankedKVCacheManager(KVCacheManager):
    """`KVCacheManager` of a multi-rank instance: each request's blocks on one rank (see module docstring)."""

    block_pool: RankedBlockPool

    def __init__(self, block_pool: RankedBlockPool, slots: RankedStateSlotPool) -> None:
        super().__init__(block_pool)  # type: ignore[arg-type]
        self.slots = slots
        self.world_size = block_pool.world_size
        self._rank_of: dict[str, int] = {}
        self._preferred: dict[str, int] = {}  # req_id -> the rank a balancer picked (`prefer_rank`), until placed
        slots.rank_of_request = self.rank_of

    @property
    def num_blocks(self) -> int:
        """Blocks of one rank's pool: the most one request can hold (what the scheduler checks requests against)."""
        return self.block_pool.blocks_per_rank

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the rank with the most: what a new request can take at most (so that `num_blocks -
        num_free_blocks` is the load of the fullest-free rank, and never negative)."""
        return max(self.block_pool.num_free_blocks_of(r) for r in range(self.world_size))

    def rank_of(self, req_id: str) -> int | None:
        """The rank request `req_id`'s blocks live on (None before its first allocation)."""
        return self._rank_of.get(req_id)

    def shares_pool(self, a: CacheRequest, b: CacheRequest) -> bool:
        """Requests on one rank share its pool: preempting `a` makes room for `b` only then."""
        return self._rank_of.get(a.req_id) == self._rank_of.get(b.req_id)

    def _has_slot(self, req_id: str, rank: int) -> bool:
        held = self.slots.get_slot_id(req_id)
        if held is not None:
            return held % self.world_size == rank
        return self.slots.num_free_slots_of(rank) > 0

    def prefer_rank(self, req_id: str, rank: int | None) -> None:
        """Place request `req_id` (not yet added) on `rank` when it has a free slot and room for it (a balancer's
        pick); else the usual choice. None drops a preference."""
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of this instance's {self.world_size} ranks")
        if rank is None:
            self._preferred.pop(req_id, None)
        else:
            self._preferred[req_id] = rank

    def _pick_rank(self, req: CacheRequest) -> tuple[int, list[int]]:
        """The rank a new request goes to and the global ids of its prefix hit there."""
        pool = self.block_pool
        preferred = self._preferred.pop(req.req_id, None)
        num_tokens = len(req.all_token_ids)
        hashes = (self._block_hashes(req, (num_tokens - 1) // self.block_size)
                  if self.enable_prefix_caching else [])
        best: tuple | None = None
        for r in range(self.world_size):
            if not self._has_slot(req.req_id, r):
                continue
            hit = []
            for h in hashes:
                b = pool.get_cached_block(h, rank=r)
                if b is None:
                    break
                hit.append(b)
            free = pool.num_free_blocks_of(r)
            has_room = free - sum(1 for b in hit if pool.ref_count(b) == 0) >= self.num_blocks_for(num_tokens) - len(hit)
            key = (has_room, has_room and r == preferred, len(hit) if has_room else 0, free, -r)
            if best is None or key > best[0]:
                best = (key, r, hit)
        if best is None:  # no slot anywhere (the scheduler checks first): the most free blocks
            r = max(range(self.world_size), key=lambda r: (pool.num_free_blocks_of(r), -r))
            return r, []
        return best[1], best[2]

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[int], int]:
        """Picks the request's rank (the one holding its longest prefix with room, see the module docstring) and
        returns its hit there."""
        rank, hit = self._pick_rank(req)
        self._rank_of[req.req_id] = rank
        if not self.enable_prefix_caching:
            return [], 0
        self.num_prefix_query_tokens += len(req.all_token_ids)
        self.num_prefix_hit_tokens += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int, computed_block_ids: Sequence[int] = (),
                       num_computed_tokens: int | None = None, num_lookahead_tokens: int = 0) -> bool:
        rank = self._rank_of.get(req.req_id)
        if rank is None:
            rank = self._rank_of[req.req_id] = self._pick_rank(req)[0]
        with self.block_pool.on_rank(rank):
            return super().allocate_slots(req, num_new_tokens, computed_block_ids, num_computed_tokens,
                                          num_lookahead_tokens)

    def fork(self, parent_req: CacheRequest, child_req: CacheRequest, num_tokens: int | None = None):
        rank = self._rank_of[parent_req.req_id]
        self._rank_of[child_req.req_id] = rank
        with self.block_pool.on_rank(rank):
            return super().fork(parent_req, child_req, num_tokens)

    def free(self, req: CacheRequest) -> None:
        super().free(req)
        self._preferred.pop(req.req_id, None)
        self._rank_of.pop(req.req_id, None)  # a resumed request picks its rank afresh (its KV is recomputed)
