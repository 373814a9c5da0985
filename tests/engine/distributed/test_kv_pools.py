"""Per-rank KV pools of a multi-rank instance (`engine.distributed.kv_pools`), in process: block ids carry
their rank, a new request goes to the rank holding its prefix when that rank has room, its state slot is
on the same rank, and a rank's attention reads local ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from deepinfer.engine.cache.block_pool import NoFreeSlotsError
from deepinfer.engine.distributed.kv_pools import (
    RankedBlockPool,
    RankedKVCacheManager,
    RankedStateSlotPool,
    RankLoad,
    locate_blocks,
    rank_loads,
    to_local_block_table,
)
from deepinfer.engine.distributed.plan import rank_of_slot

BS = 4


@dataclass
class _Req:
    req_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


def _manager(world=2, blocks=8, slots=4):
    slot_pool = RankedStateSlotPool(slots, world)
    return RankedKVCacheManager(RankedBlockPool(world, blocks, BS), slot_pool), slot_pool


def _admit(kv, slots, req):
    """What the scheduler does for a waiting request: prefix lookup, blocks, then the slot."""
    hit, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - n, hit, num_computed_tokens=n)
    req.num_computed_tokens = len(req.all_token_ids)
    return slots.allocate(req.req_id), hit


def test_block_ids_carry_the_rank_and_a_prefix_hit_sends_the_request_to_that_rank():
    kv, slots = _manager()
    prefix = list(range(100, 112))  # 3 full blocks
    a = _Req("a", prefix + [1, 2])
    slot_a, hit = _admit(kv, slots, a)
    assert hit == []
    rank_a = rank_of_slot(slot_a, 2)
    ids_a = kv.get_block_ids(a)
    assert all(b // 8 == rank_a for b in ids_a)  # every block of `a` on its rank
    assert to_local_block_table(ids_a, 8, rank_a) == [b - 8 * rank_a for b in ids_a]
    with pytest.raises(ValueError, match="another rank"):
        to_local_block_table(ids_a, 8, 1 - rank_a)
    kv.cache_full_blocks(a, len(a.all_token_ids))
    other = _Req("other", [7] * 6)  # no prefix: the rank with more free blocks, i.e. not a's
    slot_o, _ = _admit(kv, slots, other)
    assert rank_of_slot(slot_o, 2) == 1 - rank_a
    b = _Req("b", prefix + [9])
    slot_b, hit_b = _admit(kv, slots, b)
    assert rank_of_slot(slot_b, 2) == rank_a and hit_b == ids_a[:3]  # to the rank holding the prefix
    assert kv.num_prefix_hit_tokens == 12
    # the scheduler's view: a rank's pool is the most one request can use; free = the emptiest rank's
    assert kv.num_blocks == 8 and kv.block_pool.num_blocks == 16
    assert kv.num_free_blocks == 8 - 2 and kv.usage == 7 / 16  # a, b: 4 + 1 blocks on a's rank; other: 2
    hashes = [kv.block_pool.block_hash(g) for g in range(kv.block_pool.num_blocks)]
    assert sum(h is not None for h in hashes) == 3  # the cached blocks of every rank are listed


def test_a_request_goes_elsewhere_when_the_prefix_rank_has_no_room():
    kv, slots = _manager(world=2, blocks=4, slots=4)
    prefix = list(range(50, 58))  # 2 full blocks
    a = _Req("a", prefix + [1] * 7)  # 4 blocks: a's rank is full
    slot_a, _ = _admit(kv, slots, a)
    rank_a = rank_of_slot(slot_a, 2)
    kv.cache_full_blocks(a, len(a.all_token_ids))
    filler = _Req("filler", [3] * 3)  # 1 block on the other rank
    _admit(kv, slots, filler)
    big = _Req("big", prefix + list(range(4)))  # 3 blocks: a's rank has the 2-block hit but no free block
    slot_big, hit = _admit(kv, slots, big)
    assert rank_of_slot(slot_big, 2) != rank_a and hit == []


def test_slots_follow_the_rank_and_run_out_per_rank():
    kv, slots = _manager(world=2, blocks=8, slots=2)  # one slot per rank
    reqs = [_Req(str(i), [i] * 5) for i in range(2)]
    got = {rank_of_slot(_admit(kv, slots, r)[0], 2) for r in reqs}
    assert got == {0, 1}
    kv.free(reqs[0])
    slots.free("0")
    assert slots.num_free_slots_of(0) + slots.num_free_slots_of(1) == 1
    c = _Req("c", [4] * 5)
    slot_c, _ = _admit(kv, slots, c)  # only the freed rank has a slot
    assert all(b // 8 == rank_of_slot(slot_c, 2) for b in kv.get_block_ids(c))
    slots.rank_of_request = lambda req_id: 1 - rank_of_slot(slot_c, 2)
    with pytest.raises(NoFreeSlotsError, match="rank"):
        slots.allocate("d")


def test_only_requests_of_the_same_rank_share_a_pool():
    kv, slots = _manager()
    a, b, c = _Req("a", [1] * 5), _Req("b", [2] * 5), _Req("c", [3] * 5)
    ranks = [rank_of_slot(_admit(kv, slots, r)[0], 2) for r in (a, b, c)]
    assert ranks == [0, 1, 0]  # new requests spread to the emptier rank
    assert kv.shares_pool(a, c) and not kv.shares_pool(a, b)


def test_locate_blocks_names_the_rank_its_local_ids_and_slot():
    assert locate_blocks([9, 10, 12], 8, 2, slot=3) == (1, [1, 2, 4], 1)  # slots interleave: 3 = rank 1's slot 1
    assert locate_blocks([0, 1], 8, 4) == (0, [0, 1], None)
    with pytest.raises(ValueError, match="another rank"):
        locate_blocks([7, 8], 8, 2)
    with pytest.raises(ValueError, match="slot 2 is rank 0's"):
        locate_blocks([8], 8, 2, slot=2)


def test_a_balancer_picked_rank_is_taken_when_it_has_room_and_rank_loads_count_it():
    kv, slots = _manager(world=2, blocks=4, slots=4)
    load = _Req("load", [5] * 7)  # a decode reservation: blocks imported for the prompt, no prefix lookup
    kv.prefer_rank("load", 1)
    ids = kv.import_blocks(load, 7)
    assert [b // 4 for b in ids] == [1, 1] and rank_of_slot(slots.allocate("load"), 2) == 1
    kv.prefer_rank("full", 1)  # rank 1 has 2 free blocks, the request needs 3: the other rank
    assert {b // 4 for b in kv.import_blocks(_Req("full", [6] * 10), 10)} == {0}
    with pytest.raises(ValueError, match="not one of"):
        kv.prefer_rank("x", 2)
    assert rank_loads(kv, running_req_ids=["load"]) == [RankLoad(0, 4, 3, 0, 1), RankLoad(1, 4, 2, 1, 0)]
