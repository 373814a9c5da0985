"""Balancer: filtering (health, draining, exclusions, datacenter), errors, pick accounting, balance."""

from __future__ import annotations

import pytest

from deepinfer.loadbalancer import (
    Balancer,
    InstanceLoad,
    InsufficientCapacity,
    NoHealthyInstance,
    RequestInfo,
    RequestTooLarge,
    Stage,
)
from deepinfer.loadbalancer.policies import make_policy
from tests.loadbalancer.factories import add, make_membership


def test_no_instance_raises_naming_the_stage():
    members, _ = make_membership()
    balancer = Balancer("decode", "kv_load", members)
    with pytest.raises(NoHealthyInstance, match="no healthy decode instance: none registered") as e:
        balancer.pick()
    assert e.value.stage is Stage.DECODE
    add(members, "d0", Stage.DECODE, is_healthy=False)
    add(members, "d1", Stage.DECODE, is_draining=True)
    with pytest.raises(NoHealthyInstance, match="d0=unhealthy, d1=draining"):
        balancer.pick()
    with pytest.raises(NoHealthyInstance):
        Balancer("prefill", "round_robin", members).pick()  # other stages' instances do not count


def test_draining_and_excluded_instances_are_skipped():
    members, _ = make_membership()
    for name in ("a", "b", "c"):
        add(members, name, Stage.VISION)
    members.heartbeat("a", InstanceLoad(is_draining=True))
    balancer = Balancer(Stage.VISION, "round_robin", members)
    assert {balancer.pick().instance_id for _ in range(4)} == {"b", "c"}
    assert balancer.pick(RequestInfo(exclude_instance_ids={"b"})).instance_id == "c"
    with pytest.raises(NoHealthyInstance, match="excluded"):
        balancer.pick(RequestInfo(exclude_instance_ids={"b", "c"}))


def test_preferred_datacenter_with_fallback():
    members, _ = make_membership()
    add(members, "a", Stage.VISION, datacenter="dc-a")
    add(members, "b", Stage.VISION, datacenter="dc-b")
    balancer = Balancer(Stage.VISION, "round_robin", members)
    assert {balancer.pick(RequestInfo(preferred_datacenter="dc-b")).instance_id for _ in range(3)} == {"b"}
    assert {balancer.pick(RequestInfo(preferred_datacenter="dc-z")).instance_id for _ in range(3)} == {"a", "b"}


def test_kv_load_without_room_raises_insufficient_capacity():
    members, _ = make_membership()
    add(members, "d0", Stage.DECODE, num_kv_blocks_total=4)
    balancer = Balancer(Stage.DECODE, "kv_load", members)
    with pytest.raises(RequestTooLarge, match="more KV blocks than any"):  # a subclass: waiting cannot help
        balancer.pick(RequestInfo(num_kv_blocks_needed=5))
    assert balancer.pick(RequestInfo(num_kv_blocks_needed=3)).instance_id == "d0"
    with pytest.raises(InsufficientCapacity, match="has room") as e:  # holds 3 of 4 blocks until the next heartbeat
        balancer.pick(RequestInfo(num_kv_blocks_needed=2))
    assert not isinstance(e.value, RequestTooLarge)
    members.heartbeat("d0", InstanceLoad(num_kv_blocks_total=4))
    assert balancer.pick(RequestInfo(num_kv_blocks_needed=2)).instance_id == "d0"


def test_picks_between_heartbeats_spread_out():
    members, _ = make_membership()
    add(members, "p0", block_size=4)
    add(members, "p1", block_size=4, cached_block_hashes={1, 2})
    balancer = Balancer("prefill", "prefix_aware", members)
    request = RequestInfo(block_hashes=(1, 2, 3), num_prompt_tokens=100)
    picks = [balancer.pick(request).instance_id for _ in range(4)]
    assert picks == ["p1", "p0", "p1", "p0"]  # 8 cached tokens each time; queues grow by 92 / 100
    assert members.get("p1").load.num_queued_prefill_tokens == 2 * 92
    assert members.get("p0").load.num_queued_prefill_tokens == 2 * 100


def test_silent_instance_is_never_picked_after_its_timeout():
    members, clock = make_membership(timeout_s=3.0)
    add(members, "a", Stage.VISION)
    add(members, "b", Stage.VISION)
    balancer = Balancer(Stage.VISION, "round_robin", members)
    clock.advance(2.0)
    members.heartbeat("b", InstanceLoad())
    clock.advance(1.0)
    assert {balancer.pick().instance_id for _ in range(4)} == {"b"}


def test_balance_is_max_over_mean_of_pickable_loads():
    members, _ = make_membership()
    balancer = Balancer(Stage.DECODE, make_policy("kv_load"), members)
    assert balancer.balance() == 0.0 and balancer.mean_balance() == 0.0
    add(members, "d0", Stage.DECODE, num_kv_blocks_total=100)
    add(members, "d1", Stage.DECODE, num_kv_blocks_total=100)
    assert balancer.balance() == 1.0  # all idle
    members.heartbeat("d0", InstanceLoad(num_kv_blocks_used=30, num_kv_blocks_total=100))
    members.heartbeat("d1", InstanceLoad(num_kv_blocks_used=10, num_kv_blocks_total=100))
    assert balancer.balance() == pytest.approx(1.5)
    add(members, "d2", Stage.DECODE, is_healthy=False, num_kv_blocks_used=99)
    assert balancer.balance() == pytest.approx(1.5)  # unhealthy instances do not count
    assert balancer.pick(RequestInfo(num_kv_blocks_needed=20)).instance_id == "d1"
    assert balancer.balance() == 1.0 == balancer.mean_balance()  # 30 and 30 after the pick
