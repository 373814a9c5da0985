"""The prefill balancer's store-aware prefix policy: a prefix the shared store holds counts on every instance."""

from __future__ import annotations

from deepinfer.loadbalancer import RequestInfo, Stage, make_policy
from tests.loadbalancer.factories import FakeClock, add, make_membership


def _cands(loads):
    members, _ = make_membership()
    for instance_id, load in loads.items():
        add(members, instance_id, Stage.PREFILL, block_size=4, **load)
    return members.pickable(Stage.PREFILL)


def test_a_stored_prefix_goes_to_the_least_loaded_instance():
    hashes = (21, 22, 23, 24, 25)  # 5 blocks of 4 tokens
    request = RequestInfo(block_hashes=hashes, num_prompt_tokens=22)
    loads = {"busy": {"num_queued_prefill_tokens": 30, "cached_block_hashes": set(hashes)},
             "idle": {"num_queued_prefill_tokens": 0}}
    cands = _cands(loads)
    # prefix_aware: the local hit (20 tokens) is worth less than the 30 queued tokens ... idle
    assert make_policy("prefix_aware").select(cands, request).instance_id == "idle"
    loads["busy"]["num_queued_prefill_tokens"] = 10
    cands = _cands(loads)
    assert make_policy("prefix_aware").select(cands, request).instance_id == "busy"  # 20 - 10 > 0
    # with the shared store the idle instance loads the same prefix: 0.9 * 20 - 0 > 20 - 10
    assert make_policy("prefix_store_aware").select(cands, request).instance_id == "idle"


def test_routed_prefixes_count_as_stored_until_their_ttl():
    clock = FakeClock()
    policy = make_policy("prefix_store_aware", store_ttl_s=100.0, clock=clock)
    hashes = (31, 32, 33)
    cands = _cands({"a": {"num_queued_prefill_tokens": 5}, "b": {"num_queued_prefill_tokens": 6}})
    assert policy.stored_prefix_blocks(cands, hashes) == 0
    policy.select(cands, RequestInfo(block_hashes=hashes, num_prompt_tokens=12))
    assert policy.stored_prefix_blocks(cands, hashes) == 3
    assert policy.stored_prefix_blocks(cands, (31, 99, 33)) == 1  # only the leading chain
    clock.advance(101)
    assert policy.stored_prefix_blocks(cands, hashes) == 0
