"""Routing policies on hand-built candidates: registry, round robin, power of two, prefix aware, KV load."""

from __future__ import annotations

import pytest

from deepinfer.loadbalancer import POLICIES, InstanceLoad, Policy, RequestInfo, Stage, make_policy, register_policy
from deepinfer.loadbalancer.policies import matched_prefix_tokens, num_kv_blocks_needed
from tests.loadbalancer.factories import add, make_membership


def _candidates(stage: Stage, loads: dict[str, dict], block_size: int = 4):
    members, _ = make_membership()
    for instance_id, load in loads.items():
        add(members, instance_id, stage, block_size=block_size, **(load or {"is_healthy": True}))
    return members.pickable(stage)


def _ids(policy, candidates, request=None, n=1):
    return [policy.select(candidates, request or RequestInfo()).instance_id for _ in range(n)]


def test_registry():
    assert {"round_robin", "power_of_two", "prefix_aware", "kv_load"} <= set(POLICIES)
    assert make_policy("kv_load").name == "kv_load"
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("random")
    with pytest.raises(ValueError, match="already registered"):
        register_policy("round_robin")(type("Again", (Policy,), {"select": lambda self, c, r: c[0]}))

    @register_policy("test_last")
    class Last(Policy):
        def select(self, candidates, request):
            return candidates[-1]

    try:
        assert _ids(make_policy("test_last"), _candidates(Stage.PREFILL, {"a": None, "b": None})) == ["b"]
    finally:
        del POLICIES["test_last"]


def test_round_robin_cycles_and_survives_membership_changes():
    policy = make_policy("round_robin")
    abc = _candidates(Stage.VISION, {"a": None, "b": None, "c": None})
    assert _ids(policy, abc, n=4) == ["a", "b", "c", "a"]
    ac = [c for c in abc if c.instance_id != "b"]
    assert _ids(policy, ac, n=2) == ["c", "a"]
    assert _ids(policy, abc, n=2) == ["b", "c"]


def test_power_of_two_is_seeded_and_never_picks_the_busiest():
    loads = {f"i{k}": {"num_running_requests": k} for k in range(5)}
    cands = _candidates(Stage.VISION, loads)
    first = _ids(make_policy("power_of_two", seed=7), cands, n=50)
    assert first == _ids(make_policy("power_of_two", seed=7), cands, n=50)
    assert "i4" not in first and len(set(first)) > 1
    two = _candidates(Stage.DECODE, {"x": {"num_kv_blocks_used": 9}, "y": {"num_kv_blocks_used": 1}})
    assert set(_ids(make_policy("power_of_two"), two, n=10)) == {"y"}
    assert _ids(make_policy("power_of_two"), two[:1]) == ["x"]


def test_prefix_aware_prefers_the_cache_until_the_queue_outweighs_it():
    hashes = (11, 12, 13, 14)  # 4 blocks of 4 tokens
    request = RequestInfo(block_hashes=hashes, num_prompt_tokens=18)
    loads = {"cold": {"num_queued_prefill_tokens": 0},
             "warm": {"num_queued_prefill_tokens": 10, "cached_block_hashes": {11, 12, 13}}}
    cands = _candidates(Stage.PREFILL, loads)
    assert matched_prefix_tokens(cands[1], request) == 12
    assert _ids(make_policy("prefix_aware"), cands, request) == ["warm"]  # 12 - 10 > 0 - 0
    assert _ids(make_policy("prefix_aware", alpha=0.5), cands, request) == ["cold"]  # 6 - 10 < 0
    loads["warm"]["num_queued_prefill_tokens"] = 13
    assert _ids(make_policy("prefix_aware"), _candidates(Stage.PREFILL, loads), request) == ["cold"]


def test_prefix_aware_matches_only_the_leading_prefix_and_breaks_ties_by_load():
    request = RequestInfo(block_hashes=(1, 2, 3), num_prompt_tokens=12)
    loads = {"gap": {"cached_block_hashes": {2, 3}, "num_queued_prefill_tokens": 0},
             "head": {"cached_block_hashes": {1}, "num_queued_prefill_tokens": 0}}
    assert _ids(make_policy("prefix_aware"), _candidates(Stage.PREFILL, loads), request) == ["head"]
    # equal scores (4 - 4 == 0 - 0): fewer queued tokens wins
    loads = {"a": {"cached_block_hashes": {1}, "num_queued_prefill_tokens": 4},
             "b": {"num_queued_prefill_tokens": 0}}
    assert _ids(make_policy("prefix_aware"), _candidates(Stage.PREFILL, loads), request) == ["b"]
    # no hashes: least queued, then fewest requests, then id
    loads = {"a": {"num_queued_prefill_tokens": 5}, "b": {"num_running_requests": 2}, "c": {"num_running_requests": 1}}
    assert _ids(make_policy("prefix_aware"), _candidates(Stage.PREFILL, loads)) == ["c"]
    with pytest.raises(ValueError):
        make_policy("prefix_aware", alpha=-1)


def test_kv_load_orders_by_blocks_then_requests_and_refuses_full_instances():
    policy = make_policy("kv_load")
    loads = {"a": {"num_kv_blocks_used": 5, "num_kv_blocks_total": 10},
             "b": {"num_kv_blocks_used": 3, "num_kv_blocks_total": 10, "num_running_requests": 4},
             "c": {"num_kv_blocks_used": 3, "num_kv_blocks_total": 10, "num_running_requests": 2}}
    cands = _candidates(Stage.DECODE, loads)
    assert _ids(policy, cands) == ["c"]
    assert _ids(policy, cands, RequestInfo(num_kv_blocks_needed=7)) == ["c"]
    assert policy.select(cands, RequestInfo(num_kv_blocks_needed=8)) is None
    # derived need: (27 prompt tokens + 1) / block_size 4 = 7 blocks
    request = RequestInfo(num_prompt_tokens=27)
    assert num_kv_blocks_needed(cands[0], request) == 7
    assert _ids(policy, cands, request) == ["c"]
    assert policy.select(cands, RequestInfo(num_prompt_tokens=28)) is None
    # an instance that never reported its pool has no room
    assert policy.select(_candidates(Stage.DECODE, {"new": {"is_healthy": True}}), request) is None


def test_instance_load_free_blocks_never_negative():
    assert InstanceLoad(num_kv_blocks_used=5, num_kv_blocks_total=3).num_kv_blocks_free == 0
