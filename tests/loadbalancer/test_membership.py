"""Membership: registration, heartbeat expiry on a fake clock, health flags, cached hash sets."""

from __future__ import annotations

import pytest

from deepinfer.loadbalancer import DEFAULT_HEARTBEAT_TIMEOUT_S, InstanceInfo, InstanceLoad, Membership, Stage
from tests.loadbalancer.factories import add, make_membership


def test_registered_instance_is_pickable_at_once():
    members, _ = make_membership()
    add(members, "p1")
    add(members, "p0")
    assert [i.instance_id for i in members.pickable(Stage.PREFILL)] == ["p0", "p1"]
    assert members.pickable(Stage.DECODE) == []
    assert len(members) == 2


def test_silent_instance_is_dropped_at_the_timeout():
    members, clock = make_membership()
    assert Membership().heartbeat_timeout_s == DEFAULT_HEARTBEAT_TIMEOUT_S == 3.0
    add(members, "a")
    add(members, "b")
    for _ in range(4):  # b keeps heartbeating, a stays silent
        clock.advance(0.99)
        assert members.heartbeat("b", InstanceLoad()).is_known
    # a was last seen 3.96 s ago
    assert [i.instance_id for i in members.instances()] == ["b"]
    assert members.get("a") is None
    result = members.heartbeat("a", InstanceLoad())
    assert not result.is_known  # must register again
    add(members, "a")
    assert members.get("a") is not None


def test_expiry_boundary():
    members, clock = make_membership(timeout_s=3.0)
    add(members, "a")
    clock.advance(2.999)
    assert members.get("a") is not None
    clock.advance(0.001)
    assert members.expire() == ["a"]
    assert members.instances() == []


def test_unhealthy_and_draining_stay_listed_but_not_pickable():
    members, _ = make_membership()
    add(members, "a")
    add(members, "b")
    members.heartbeat("a", InstanceLoad(is_healthy=False))
    members.heartbeat("b", InstanceLoad(is_draining=True))
    assert [i.instance_id for i in members.instances(Stage.PREFILL)] == ["a", "b"]
    assert members.pickable(Stage.PREFILL) == []
    members.heartbeat("a", InstanceLoad())
    assert [i.instance_id for i in members.pickable(Stage.PREFILL)] == ["a"]


def test_deregister_and_reregister_replaces():
    members, _ = make_membership()
    add(members, "a", num_queued_prefill_tokens=50)
    assert members.deregister("a")
    assert not members.deregister("a")
    add(members, "a", num_queued_prefill_tokens=7)
    add(members, "a")  # a restart: fresh state
    assert members.get("a").load == InstanceLoad()


def test_cached_hashes_full_then_delta():
    members, _ = make_membership()
    inst = add(members, "a")
    assert members.heartbeat("a", InstanceLoad(cached_block_hashes={1, 2}, is_cached_hashes_delta=True)) \
        .needs_full_cached_hashes  # a delta alone cannot be trusted to be complete
    assert inst.cached_block_hashes == {1, 2}
    assert not members.heartbeat("a", InstanceLoad(cached_block_hashes={1, 2, 3})).needs_full_cached_hashes
    members.heartbeat("a", InstanceLoad(cached_block_hashes={4}, evicted_block_hashes={1}, is_cached_hashes_delta=True))
    assert inst.cached_block_hashes == {2, 3, 4}
    assert inst.load.cached_block_hashes == frozenset()  # hashes live on the instance, not in the load
    members.heartbeat("a", InstanceLoad(cached_block_hashes={9}))
    assert inst.cached_block_hashes == {9}


def test_register_with_full_hashes_needs_no_full_report():
    members, _ = make_membership()
    add(members, "a", cached_block_hashes={5})
    assert members.get("a").cached_block_hashes == {5}
    assert not members.heartbeat("a", InstanceLoad(is_cached_hashes_delta=True)).needs_full_cached_hashes


def test_pending_load_is_replaced_by_the_next_heartbeat():
    members, _ = make_membership()
    add(members, "a", num_queued_prefill_tokens=10, num_kv_blocks_total=8)
    members.add_pending("a", num_prefill_tokens=5, num_requests=1, num_kv_blocks=2)
    load = members.get("a").load
    assert (load.num_queued_prefill_tokens, load.num_waiting_requests, load.num_kv_blocks_used) == (15, 1, 2)
    assert load.num_kv_blocks_free == 6
    members.heartbeat("a", InstanceLoad(num_queued_prefill_tokens=3))
    assert members.get("a").load.num_queued_prefill_tokens == 3
    members.add_pending("gone", num_requests=1)  # unknown ids are ignored


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Membership(heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="instance_id"):
        InstanceInfo("", Stage.DECODE)
    with pytest.raises(ValueError):
        InstanceInfo("a", "encoder")
    assert InstanceInfo("a", "decode").stage is Stage.DECODE
