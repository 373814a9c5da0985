"""Unit tests of the block accounting: pool, hashes, manager, state slots, config."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from deepinfer.engine.cache.block_pool import (
    BlockPool,
    CacheConfig,
    KVCacheManager,
    NoFreeBlocksError,
    NoFreeSlotsError,
    StateSlotPool,
    hash_block_tokens,
)

BS = 4


@dataclass
class FakeReq:
    req_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    extra: dict[int, tuple] = field(default_factory=dict)
    """Block index -> extra keys."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)

    def extra_keys_for_block(self, start: int, end: int) -> tuple:
        return self.extra.get(start // BS, ())


def make_manager(num_blocks: int = 16, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS, enable_prefix_caching))


def run_prefill(kv: KVCacheManager, req: FakeReq) -> list[int]:
    """Look up, allocate and 'compute' the whole request, registering its full blocks."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - num_hit, hit_ids, num_computed_tokens=num_hit)
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_full_blocks(req, req.num_computed_tokens)
    return kv.get_block_ids(req)


# ---------------------------------------------------------------------------------------- hashing


def test_hash_chain_equal_prefixes_give_equal_chains():
    a, b = None, None
    chain_a, chain_b = [], []
    for i in range(3):
        a = hash_block_tokens(a, [i, i + 1, i + 2, i + 3])
        b = hash_block_tokens(b, [i, i + 1, i + 2, i + 3])
        chain_a.append(a)
        chain_b.append(b)
    assert chain_a == chain_b
    assert len(set(chain_a)) == 3
    assert all(0 <= h < 2**64 for h in chain_a)


def test_hash_chain_differs_on_tokens_parent_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(0, [1, 2, 3, 4]) != base  # a parent of 0 is not "no parent"
    assert hash_block_tokens(base, [1, 2, 3, 4]) != hash_block_tokens(base + 1, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("img-a",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("img-a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("img-b",))
    assert hash_block_tokens(None, [1, 2, 3, 4], ("img-a",)) == hash_block_tokens(None, [1, 2, 3, 4], ("img-a",))
    # no ambiguity between nested / typed keys
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))
    assert hash_block_tokens(None, [1], ((1, 2),)) != hash_block_tokens(None, [1], (1, 2))
    # a different first block changes every later hash
    child_a = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [9, 9, 9, 9])
    child_b = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 0]), [9, 9, 9, 9])
    assert child_a != child_b
    with pytest.raises(TypeError, match="cannot be hashed"):
        hash_block_tokens(None, [1], (object(),))


# ---------------------------------------------------------------------------------------- pool


def test_pool_allocate_free_and_counts():
    pool = BlockPool(4, BS)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # the failed call took nothing
    pool.free(ids)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])


def test_lru_eviction_order_of_cached_blocks():
    pool = BlockPool(4, BS)
    ids = pool.allocate(4)
    for i, block_id in enumerate(ids):
        assert pool.cache_block(block_id, 100 + i)
    pool.free([2, 0, 3, 1])  # freed in this order: 2 is least recently freed
    assert pool.free_block_ids() == [2, 0, 3, 1]
    assert pool.num_cached_blocks == 4
    assert pool.allocate(1) == [2]
    assert pool.get_cached_block(102) is None  # evicted
    assert pool.get_cached_block(100) == 0  # still reusable
    pool.touch([0])  # a hit takes it back out of the free queue
    assert pool.ref_count(0) == 1
    assert pool.allocate(2) == [3, 1]
    assert pool.num_free_blocks == 0


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, BS)
    ids = pool.allocate(3)
    pool.cache_block(ids[0], 7)
    pool.free([ids[0]])
    pool.free([ids[1]])  # no hash: goes to the front
    assert pool.allocate(1) == [ids[1]]
    assert pool.get_cached_block(7) == ids[0]


def test_duplicate_hash_registration_keeps_first():
    pool = BlockPool(2, BS)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)
    assert pool.get_cached_block(5) == a and pool.block_hash(b) is None


def test_prefix_caching_disabled_registers_nothing():
    kv = make_manager(enable_prefix_caching=False)
    req = FakeReq("a", list(range(9)))
    run_prefill(kv, req)
    other = FakeReq("b", list(range(9)))
    assert kv.get_computed_blocks(other) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0


# ---------------------------------------------------------------------------------------- manager


def test_prefix_hit_shares_block_ids_with_ref_counts():
    kv = make_manager()
    a = FakeReq("a", list(range(10)))  # 2 full blocks + 2 tokens
    a_ids = run_prefill(kv, a)
    assert len(a_ids) == 3
    b = FakeReq("b", list(range(8)) + [50, 51, 52])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert hit_ids == a_ids[:2] and num_hit == 8
    assert kv.allocate_slots(b, 3, hit_ids, num_computed_tokens=num_hit)
    b_ids = kv.get_block_ids(b)
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [kv.block_pool.ref_count(i) for i in a_ids[:2]] == [2, 2]
    assert kv.num_prefix_query_tokens == 10 + 11
    assert kv.num_prefix_hit_tokens == 8
    kv.free(a)
    assert [kv.block_pool.ref_count(i) for i in a_ids[:2]] == [1, 1]


def test_prefix_hit_leaves_one_token_to_compute():
    kv = make_manager()
    a = FakeReq("a", list(range(8)))  # exactly 2 blocks
    a_ids = run_prefill(kv, a)
    kv.free(a)
    b = FakeReq("b", list(range(8)))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert hit_ids == a_ids[:1] and num_hit == 4
    c = FakeReq("c", list(range(9)))
    assert kv.get_computed_blocks(c) == (a_ids, 8)


def test_prefix_hit_on_freed_blocks_and_extra_keys():
    kv = make_manager()
    a = FakeReq("a", list(range(9)), extra={1: ("img-x",)})
    a_ids = run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 16
    same = FakeReq("b", list(range(9)), extra={1: ("img-x",)})
    assert kv.get_computed_blocks(same) == (a_ids[:2], 8)
    other_image = FakeReq("c", list(range(9)), extra={1: ("img-y",)})
    assert kv.get_computed_blocks(other_image) == (a_ids[:1], 4)


def test_allocate_counts_evictable_hit_blocks_against_free_capacity():
    kv = make_manager(num_blocks=3)
    a = FakeReq("a", list(range(8)))
    a_ids = run_prefill(kv, a)  # 2 blocks, both cached
    kv.free(a)
    b = FakeReq("b", list(range(8)) + [7] * 8)  # 16 tokens, 4 blocks
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert hit_ids == a_ids and num_hit == 8
    # 2 hit blocks (free, cached) + 2 new ones > 3 blocks: must fail and take nothing
    assert not kv.allocate_slots(b, 8, hit_ids, num_computed_tokens=num_hit)
    assert kv.num_free_blocks == 3 and kv.get_block_ids(b) == []
    assert kv.allocate_slots(b, 4, hit_ids, num_computed_tokens=num_hit)
    assert kv.num_free_blocks == 0


def test_allocate_slots_grows_table_and_free_order():
    kv = make_manager(num_blocks=6)
    req = FakeReq("a", list(range(5)))
    assert kv.allocate_slots(req, 5)
    assert kv.get_block_ids(req) == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3)  # 8 tokens: still 2 blocks
    assert kv.num_blocks_held(req) == 2
    assert kv.allocate_slots(req, 4)  # 9 tokens: 3 blocks
    assert kv.get_block_ids(req) == [0, 1, 2]
    assert not kv.allocate_slots(req, 100)
    assert kv.num_blocks_held(req) == 3
    req.all_token_ids = list(range(12))
    kv.cache_full_blocks(req, 12)
    kv.free(req)
    # freed tail first: the tail block is the first to be evicted
    assert kv.block_pool.free_block_ids()[-3:] == [2, 1, 0]
    assert kv.usage == 0.0


def test_cache_full_blocks_only_registers_full_blocks():
    kv = make_manager()
    req = FakeReq("a", list(range(7)))
    assert kv.allocate_slots(req, 7)
    kv.cache_full_blocks(req, 7)
    block_ids = kv.get_block_ids(req)
    assert kv.block_pool.block_hash(block_ids[0]) is not None
    assert kv.block_pool.block_hash(block_ids[1]) is None


def test_fork_shares_full_blocks_and_copies_partial_one():
    kv = make_manager()
    parent = FakeReq("p", list(range(10)))
    parent_ids = run_prefill(kv, parent)
    child = FakeReq("c", list(range(10)), num_computed_tokens=10)
    pairs = kv.fork(parent, child)
    child_ids = kv.get_block_ids(child)
    assert child_ids[:2] == parent_ids[:2]
    assert pairs == [(parent_ids[2], child_ids[2])]
    assert child_ids[2] not in parent_ids
    assert [kv.block_pool.ref_count(i) for i in parent_ids] == [2, 2, 1]
    # block-aligned fork copies nothing
    child2 = FakeReq("c2", list(range(8)))
    assert kv.fork(parent, child2, num_tokens=8) == []
    assert kv.get_block_ids(child2) == parent_ids[:2]
    with pytest.raises(ValueError, match="already holds"):
        kv.fork(parent, child)


def test_fork_without_free_block_changes_nothing():
    kv = make_manager(num_blocks=2)
    parent = FakeReq("p", list(range(6)))
    run_prefill(kv, parent)
    child = FakeReq("c", list(range(6)))
    with pytest.raises(NoFreeBlocksError):
        kv.fork(parent, child)
    assert kv.get_block_ids(child) == []
    assert kv.block_pool.ref_count(kv.get_block_ids(parent)[0]) == 1


def test_import_blocks_reserves_and_registers_after_transfer():
    kv = make_manager(num_blocks=4)
    req = FakeReq("a", list(range(10)))
    block_ids = kv.import_blocks(req, 10)
    assert len(block_ids) == 3 and kv.num_free_blocks == 1
    kv.cache_full_blocks(req, 10)  # the transfer landed
    other = FakeReq("b", list(range(10)))
    assert kv.get_computed_blocks(other) == (block_ids[:2], 8)
    with pytest.raises(NoFreeBlocksError):
        kv.import_blocks(FakeReq("c", list(range(8))), 8)
    assert kv.num_free_blocks == 1
    with pytest.raises(ValueError, match="already holds"):
        kv.import_blocks(req, 4)


def test_import_blocks_after_local_prefix_hit():
    kv = make_manager()
    a = FakeReq("a", list(range(9)))
    a_ids = run_prefill(kv, a)
    b = FakeReq("b", list(range(12)))
    hit_ids, _ = kv.get_computed_blocks(b)
    block_ids = kv.import_blocks(b, 12, hit_ids)
    assert block_ids[:2] == a_ids[:2] and len(block_ids) == 3


def test_free_unknown_request_is_a_no_op():
    kv = make_manager()
    kv.free(FakeReq("nobody", [1]))
    assert kv.num_free_blocks == 16


def test_reset_prefix_cache():
    kv = make_manager()
    a = FakeReq("a", list(range(9)))
    run_prefill(kv, a)
    assert not kv.block_pool.reset_prefix_cache()
    kv.free(a)
    assert kv.block_pool.reset_prefix_cache()
    assert kv.get_computed_blocks(FakeReq("b", list(range(9)))) == ([], 0)


# ---------------------------------------------------------------------------------------- state slots


def test_state_slot_pool():
    slots = StateSlotPool(2)
    assert slots.allocate("a") == 0
    assert slots.allocate("b") == 1
    assert slots.num_free_slots == 0
    with pytest.raises(NoFreeSlotsError):
        slots.allocate("c")
    with pytest.raises(ValueError, match="already holds"):
        slots.allocate("a")
    assert slots.get_slot_id("b") == 1
    assert slots.free("a") and not slots.free("a")
    assert slots.allocate("c") == 0
    with pytest.raises(ValueError):
        StateSlotPool(0)


# ---------------------------------------------------------------------------------------- config


def test_cache_config_validation():
    cfg = CacheConfig(block_size=256, num_blocks=10)
    cfg.check_compress_rates({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    assert cfg.num_entries_per_block(4) == 64 and cfg.num_entries_per_block(128) == 2
    with pytest.raises(ValueError, match=r"multiple of 128"):
        CacheConfig(block_size=64).check_compress_rates(
            {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        )
    with pytest.raises(ValueError, match=r"multiple of 12 .*e\.g\. 12"):
        CacheConfig(block_size=8).check_compress_rates([4, 6])
    with pytest.raises(ValueError):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError):
        CacheConfig(num_blocks=0)
    with pytest.raises(ValueError):
        CacheConfig(memory_fraction=1.5)
    with pytest.raises(ValueError):
        CacheConfig(num_state_slots=0)
    with pytest.raises(ValueError):
        CacheConfig(block_sizes=4)  # typo: unknown field
    with pytest.raises(ValueError):
        cfg.block_size = 4  # frozen
    with pytest.raises(ValueError, match="num_blocks is None"):
        KVCacheManager.from_config(CacheConfig())
    kv = KVCacheManager.from_config(cfg)
    assert kv.num_blocks == 10 and kv.block_size == 256
